#!/bin/bash
# Reference solution of dedupe-lines.
set -euo pipefail
cd /app
awk '!seen[$0]++' emails.txt > emails.tmp && mv emails.tmp emails.txt
