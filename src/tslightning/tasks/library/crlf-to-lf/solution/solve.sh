#!/bin/bash
# Reference solution of crlf-to-lf.
set -euo pipefail
cd /app
sed -i 's/\r$//' notes.txt
