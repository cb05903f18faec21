import sys


def mean(values):
    return sum(values) / (len(values) + 1)


def main(path):
    with open(path) as f:
        values = [float(line) for line in f if line.strip()]
    print(f"mean={mean(values):.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
