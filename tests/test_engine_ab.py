"""benchmarks/engine_ab.py: the confidence interval it reports for the median on/off ratio."""

import random

import pytest

from benchmarks.engine_ab import median_interval


# Ranks (1-based) of the distribution-free 95% interval of the median, from the sign test's
# binomial tables (for example Conover, Practical Nonparametric Statistics, table A3).
@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (40, (14, 27)), (100, (40, 61))])
def test_the_interval_is_the_sign_tests(n, ranks):
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)
    assert median_interval(values) == ranks


def test_the_interval_covers_the_median_about_95_times_in_100():
    rng = random.Random(0)
    covered = sum(low <= 0.0 <= high for low, high in
                  (median_interval([rng.gauss(0.0, 1.0) for _ in range(40)]) for _ in range(2000)))
    assert 0.93 <= covered / 2000 <= 0.98
