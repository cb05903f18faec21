#!/bin/bash
# Reference solution of rename-function.
set -euo pipefail
cd /app
grep -rl --include='*.py' calc_total src | xargs sed -i 's/\bcalc_total\b/compute_total/g'
