#!/bin/bash
# Reference solution of json-to-csv.
set -euo pipefail
cd /app
python3 - <<'PY'
import csv, json
with open("inventory.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["sku", "name", "qty"])
    for item in json.load(open("inventory.json")):
        w.writerow([item["sku"], item["name"], item["qty"]])
PY
