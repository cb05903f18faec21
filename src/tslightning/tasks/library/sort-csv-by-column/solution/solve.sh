#!/bin/bash
# Reference solution of sort-csv-by-column.
set -euo pipefail
cd /app
{ head -n 1 people.csv; tail -n +2 people.csv | sort -t, -k2,2n; } > sorted.csv
