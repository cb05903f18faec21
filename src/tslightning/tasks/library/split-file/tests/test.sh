#!/bin/bash
# Verifier of split-file: every check is one test. Writes the pass fraction to reward.txt and the
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

check "three parts" 'test "$(ls /app/parts | grep -c "^part_a[a-c]$")" = 3'
check "first part has 100 lines" 'test "$(wc -l < /app/parts/part_aa)" = 100'
check "last part has 50 lines" 'test "$(wc -l < /app/parts/part_ac)" = 50'
check "parts join back to big.txt" 'test "$(cat /app/parts/part_aa /app/parts/part_ab /app/parts/part_ac | sha256sum | cut -c1-64)" = 9a618c9801178120776fdb64d90935bbcec7c3652e4718f02fa9b0dc2c95552c'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
