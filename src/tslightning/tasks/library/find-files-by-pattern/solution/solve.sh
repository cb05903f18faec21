#!/bin/bash
# Reference solution of find-files-by-pattern.
set -euo pipefail
cd /app
find project -type f -name '*.log' > logs.txt
