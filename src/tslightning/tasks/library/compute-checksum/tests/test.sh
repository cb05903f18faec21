#!/bin/bash
# Verifier of compute-checksum: every check is one test. Writes the pass fraction to reward.txt and the
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

check "SHA256SUMS exists" 'test -f /app/SHA256SUMS'
check "three entries" 'test "$(grep -c . /app/SHA256SUMS)" = 3'
check "alpha.txt checksum" 'grep -q "^b6a98d9ce9a2d9149288fa3df42d377c3e42737afdcdaf714e33c0a100b51060  files/alpha.txt$" /app/SHA256SUMS'
check "gamma.bin checksum" 'grep -q "^fdeab9acf3710362bd2658cdc9a29e8f9c757fcf9811603a8c447cd1d9151108  files/gamma.bin$" /app/SHA256SUMS'
check "sha256sum -c verifies every entry" 'sha256sum -c --strict /app/SHA256SUMS'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
