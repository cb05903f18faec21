#!/bin/bash
# Verifier of rename-files-by-pattern: every check is one test. Writes the pass fraction to reward.txt and the
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

check "no .jpeg files remain" '! ls /app/photos | grep -q "\.jpeg$"'
check "five .jpg files" 'test "$(ls /app/photos | grep -c "^IMG_00[1-5]\.jpg$")" = 5'
check "contents are preserved" 'echo "06c35f8a0e982ebb2289823db8964376374343acea5869f6a5801f3133f47ea4  /app/photos/IMG_003.jpg" | sha256sum -c -'
check "other files are untouched" 'test "$(cat /app/photos/notes.txt)" = "keep me"'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
