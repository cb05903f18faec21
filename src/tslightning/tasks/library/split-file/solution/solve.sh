#!/bin/bash
# Reference solution of split-file.
set -euo pipefail
cd /app
mkdir -p parts
split -l 100 big.txt parts/part_
