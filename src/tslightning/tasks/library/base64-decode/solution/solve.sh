#!/bin/bash
# Reference solution of base64-decode.
set -euo pipefail
cd /app
base64 -d message.b64 > message.txt
