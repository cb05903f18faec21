#!/bin/bash
# Reference solution of csv-filter-rows.
set -euo pipefail
cd /app
awk -F, 'NR == 1 || $2 == "Engineering"' employees.csv > engineering.csv
