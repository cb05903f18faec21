#!/bin/bash
# Reference solution of pretty-print-json.
set -euo pipefail
cd /app
python3 -c 'import json; d = json.load(open("config.json")); open("config.json", "w").write(json.dumps(d, indent=2, sort_keys=True) + "\n")'
