#!/bin/bash
# Reference solution of write-count-script.
set -euo pipefail
cd /app
cat > count_txt.sh <<'SH'
#!/bin/bash
find "$1" -maxdepth 1 -type f -name '*.txt' | wc -l
SH
chmod +x count_txt.sh
