#!/bin/bash
# Reference solution of find-large-files.
set -euo pipefail
cd /app
find data -type f -size +10k > large.txt
