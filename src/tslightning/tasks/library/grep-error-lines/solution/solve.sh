#!/bin/bash
# Reference solution of grep-error-lines.
set -euo pipefail
cd /app
grep ERROR app.log > errors.log
