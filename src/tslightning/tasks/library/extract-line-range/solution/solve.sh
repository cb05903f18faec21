#!/bin/bash
# Reference solution of extract-line-range.
set -euo pipefail
cd /app
sed -n '10,20p' poem.txt > excerpt.txt
