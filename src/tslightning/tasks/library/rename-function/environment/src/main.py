import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
from billing import calc_total  # noqa: E402
from report import summary  # noqa: E402

print(calc_total([20, 22]))
print(summary([1, 2]))
