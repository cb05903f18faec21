#!/bin/bash
# Verifier of rename-function: every check is one test. Writes the pass fraction to reward.txt and the
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

check "no calc_total in .py files" '! grep -rq --include=*.py calc_total /app/src'
check "compute_total is defined" 'grep -q "^def compute_total(prices):" /app/src/billing.py'
check "report.py calls compute_total" 'grep -q "compute_total(prices)" /app/src/report.py'
check "the program runs with the new name" 'cd /app/src && python3 -c "import billing; assert billing.compute_total([1, 2]) == 3" && test "$(python3 main.py | tr "\n" " ")" = "42 total=3 "'
check "notes.txt is untouched" 'grep -q "^calc_total is documented" /app/src/notes.txt'

mkdir -p /logs/verifier
awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\n", p / t }' > /logs/verifier/reward.txt
reward=$(awk -v p="$passed" -v t="$total" 'BEGIN { r = p / t; if (p == t) r += 0.5; printf "%.6f", r }')
printf '{"tests_passed": %d, "tests_total": %d, "reward": %s}\n' "$passed" "$total" "$reward" > /logs/verifier/reward.json
echo "$passed/$total checks passed"
