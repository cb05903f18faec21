#!/bin/bash
# Reference solution of read-env-value.
set -euo pipefail
cd /app
grep '^DB_PORT=' settings.env | cut -d= -f2 > port.txt
