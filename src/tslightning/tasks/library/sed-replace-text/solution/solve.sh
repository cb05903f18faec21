#!/bin/bash
# Reference solution of sed-replace-text.
set -euo pipefail
cd /app
sed -i 's/staging\.example\.com/prod.example.com/g' config.ini
