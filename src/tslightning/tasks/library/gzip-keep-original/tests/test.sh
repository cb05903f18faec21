#!/bin/bash
# Verifier of gzip-keep-original: every check is one test. Writes the pass fraction to reward.txt and the
# counts with SETA's partial reward (p + 0.5 when all pass) to reward.json.
passed=0
total=0
check() {
    total=$((total + 1))
    if (eval "$2") >/dev/null 2>&1; then
        passed=$((passed + 1))
        echo "PASS: $1"
    else
        echo "FAIL: $1"
    fi
}
export LC_ALL=C
cd /app 2>/dev/null || echo "note: /app is missing"

check "report.txt.gz exists" 'test -f /app/report.txt.gz'
check "it is valid gzip" 'gzip -t /app/report.txt.gz'
check "it decompresses to the report" 'test "$(gzip -dc /app/report.txt.gz | sha256sum | cut -c1-64)" = 730abb85c00e5de727563bf45a4a0bf86dfa02d4a2772b38010bca643d0ca909'
check "the original is kept" 'echo "730abb85c00e5de727563bf45a4a0bf86dfa02d4a2772b38010bca643d0ca909  /app/report.txt" | sha256sum -c -'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
