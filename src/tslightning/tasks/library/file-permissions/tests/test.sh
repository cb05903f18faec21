#!/bin/bash
# Verifier of file-permissions: every check is one test. Writes the pass fraction to reward.txt and the
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

check "run.sh is executable by its owner" 'test "$(( 0$(stat -c %a /app/run.sh) & 0100 ))" -ne 0'
check "run.sh runs" 'test "$(/app/run.sh)" = running'
check "secret.key has mode 600" 'test "$(stat -c %a /app/secret.key)" = 600'
check "secret.key is unchanged" 'test "$(cat /app/secret.key)" = k3y-material'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
