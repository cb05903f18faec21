import json
import sys

expected = json.load(open("/tests/expected.json"))
sys.exit(0 if json.load(open(sys.argv[1])) == expected else 1)
