#!/bin/bash
# Reference solution of most-frequent-ip.
set -euo pipefail
cd /app
awk '{ print $1 }' access.log | sort | uniq -c | sort -rn | head -n 1 > top.tmp
awk '{ print $2 }' top.tmp > top_ip.txt
awk '{ print $1 }' top.tmp > top_count.txt
rm top.tmp
