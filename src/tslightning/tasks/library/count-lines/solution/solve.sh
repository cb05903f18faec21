#!/bin/bash
# Reference solution of count-lines.
set -euo pipefail
cd /app
wc -l < log.txt > count.txt
