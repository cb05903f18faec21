#!/bin/bash
# Reference solution of compute-checksum.
set -euo pipefail
cd /app
sha256sum files/* > SHA256SUMS
