#!/bin/bash
# Reference solution of delete-temp-files.
set -euo pipefail
cd /app
find workspace -type f -name '*.tmp' -delete
