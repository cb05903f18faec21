#!/bin/bash
# Reference solution of fix-failing-script.
set -euo pipefail
cd /app
sed -i 's/^if \[ -z "\$1" \] then$/if [ -z "$1" ]; then/' greet.sh
