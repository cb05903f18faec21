#!/bin/bash
# Reference solution of file-permissions.
set -euo pipefail
cd /app
chmod +x run.sh
chmod 600 secret.key
