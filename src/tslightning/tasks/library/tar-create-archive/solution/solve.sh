#!/bin/bash
# Reference solution of tar-create-archive.
set -euo pipefail
cd /app
tar -czf docs.tar.gz docs
