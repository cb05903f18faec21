from billing import calc_total


def summary(prices):
    return f"total={calc_total(prices)}"
