#!/bin/bash
# Reference solution of merge-csv-files.
set -euo pipefail
cd /app
{ cat jan.csv; tail -n +2 feb.csv; } > q1.csv
