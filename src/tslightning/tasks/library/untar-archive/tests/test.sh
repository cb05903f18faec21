#!/bin/bash
# Verifier of untar-archive: every check is one test. Writes the pass fraction to reward.txt and the
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

check "extracted/bundle exists" 'test -d /app/extracted/bundle'
check "config.yaml is extracted" 'echo "ae8a6571d112010e5e4d8f3b59f7829867b3036d61c31feb92b6ba3a03024798  /app/extracted/bundle/config.yaml" | sha256sum -c -'
check "data/values.txt is extracted" 'echo "14c5e74c4b96ccef41cd94db73a9ec3348038ac094feca4fd897cecffa07cdae  /app/extracted/bundle/data/values.txt" | sha256sum -c -'
check "the archive is kept" 'test -f /app/bundle.tar.gz'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
