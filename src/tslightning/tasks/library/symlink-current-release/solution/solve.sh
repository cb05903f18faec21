#!/bin/bash
# Reference solution of symlink-current-release.
set -euo pipefail
cd /app
ln -sfn releases/v2 current
