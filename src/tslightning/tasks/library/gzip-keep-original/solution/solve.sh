#!/bin/bash
# Reference solution of gzip-keep-original.
set -euo pipefail
cd /app
gzip -k report.txt
