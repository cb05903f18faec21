#!/bin/bash
# Reference solution of word-frequency.
set -euo pipefail
cd /app
tr -cs 'A-Za-z' '\n' < text.txt | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c | sort -rn | head -n 5 | awk '{print $1, $2}' > top5.txt
