import math

import pytest
from scipy import stats

from spopp.sampler import race_draws, uncertainty_weight


def test_uncertainty_weight():
    assert uncertainty_weight(0.5) == pytest.approx(0.55)
    assert uncertainty_weight(0.0) == pytest.approx(0.05)
    assert uncertainty_weight(1.0, floor=0.1) == pytest.approx(0.1)
    assert uncertainty_weight(0.2) == pytest.approx(math.sqrt(0.16) + 0.05)
    for bad in (-0.1, 1.1, math.nan):
        with pytest.raises(ValueError):
            uncertainty_weight(bad)
    with pytest.raises(ValueError):
        uncertainty_weight(0.5, floor=0.0)


def test_race_draws_are_reproducible_and_exponential():
    a = race_draws(7, "run", 0, 5000)
    assert a == race_draws(7, "run", 0, 5000)
    assert a[100:200] == race_draws(7, "run", 100, 100)
    assert a != race_draws(8, "run", 0, 5000)
    assert a != race_draws(7, "other", 0, 5000)
    assert all(x > 0 and math.isfinite(x) for x in a)
    assert stats.kstest(a, "expon").pvalue > 1e-3
