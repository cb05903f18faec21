#!/bin/bash
# Verifier of word-frequency: every check is one test. Writes the pass fraction to reward.txt and the
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

check "top5.txt exists" 'test -f /app/top5.txt'
check "five lines" 'test "$(grep -c . /app/top5.txt)" = 5'
check "most frequent word first" 'head -n 1 /app/top5.txt | grep -qx " *9 river"'
check "counts and words are right" 'diff <(sed "s/^ *//" /app/top5.txt | grep .) /tests/expected.txt'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
