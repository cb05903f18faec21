#!/bin/bash
# Reference solution of extract-json-field.
set -euo pipefail
cd /app
python3 -c 'import json; print("\n".join(u["email"] for u in json.load(open("users.json")) if u["active"]))' > emails.txt
