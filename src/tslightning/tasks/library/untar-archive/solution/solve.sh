#!/bin/bash
# Reference solution of untar-archive.
set -euo pipefail
cd /app
mkdir -p extracted && tar -xzf bundle.tar.gz -C extracted
