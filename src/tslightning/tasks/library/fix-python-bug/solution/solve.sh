#!/bin/bash
# Reference solution of fix-python-bug.
set -euo pipefail
cd /app
sed -i 's|sum(values) / (len(values) + 1)|sum(values) / len(values)|' stats.py
