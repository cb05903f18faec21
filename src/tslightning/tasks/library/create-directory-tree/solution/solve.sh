#!/bin/bash
# Reference solution of create-directory-tree.
set -euo pipefail
cd /app
mkdir -p site/css site/js site/img/icons
: > site/index.html
