#!/bin/bash
# Reference solution of count-unique-ips.
set -euo pipefail
cd /app
awk '{ print $1 }' access.log | sort -u | wc -l > unique_ips.txt
