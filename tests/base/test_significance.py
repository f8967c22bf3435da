"""megatron_pdm.significance against hand computation and known values."""

from __future__ import annotations

import math
import random

import pytest

from megatron_pdm import significance as S


def test_sign_test_exact_values():
    # 9 of 10 positive: p = 2 * (1 + 10) / 1024
    r = S.sign_test([1.0] * 9 + [-2.0] + [0.0] * 5)
    assert (r["positive"], r["negative"], r["ties"]) == (9, 1, 5)
    assert r["p"] == pytest.approx(22 / 1024)
    assert S.sign_test([0.0, 0.0])["p"] == 1.0
    assert S.sign_test([1.0, -1.0])["p"] == 1.0
    with pytest.raises(ValueError, match="value 1 is nan"):
        S.sign_test([1.0, float("nan")])


def test_sign_flip_exact_by_enumeration_and_ties_weigh_nothing():
    d = [3.0, 1.0, 2.0]
    # 8 patterns; |sum| >= 6 only for all + and all -: p = 2/8
    assert S.sign_flip_test(d)["p"] == pytest.approx(0.25)
    assert S.sign_flip_test(d + [0.0] * 50)["p"] == pytest.approx(0.25)
    assert S.sign_flip_test([0.0] * 5)["p"] == 1.0
    # symmetric data: p = 1
    assert S.sign_flip_test([1.0, -1.0])["p"] == pytest.approx(1.0)


def test_sign_flip_monte_carlo_close_to_exact():
    rng = random.Random(3)
    d = [rng.gauss(0.4, 1.0) for _ in range(22)]
    mc = S.sign_flip_test(d, resamples=20000, seed=1)
    assert not mc["exact"]
    exact = S.sign_flip_test(d[:20])
    assert exact["exact"] and 0 <= exact["p"] <= 1
    # Monte Carlo p of the same 20 values under a forced Monte Carlo path agrees with exact
    old = S.EXACT_FLIP_LIMIT
    try:
        S.EXACT_FLIP_LIMIT = 5
        approx = S.sign_flip_test(d[:20], resamples=40000, seed=2)["p"]
    finally:
        S.EXACT_FLIP_LIMIT = old
    assert abs(approx - exact["p"]) < 0.01


def test_sign_flip_has_nominal_size_on_tie_heavy_null_data():
    """75% exact zeros, the rest +-large: the test's rejection rate at 0.05 stays <= 0.05 + noise."""
    rng = random.Random(0)
    rejections = 0
    trials = 400
    for _ in range(trials):
        d = [0.0 if rng.random() < 0.75 else rng.choice((-1, 1)) * rng.uniform(20, 50)
             for _ in range(40)]
        rejections += S.sign_flip_test(d, resamples=400, seed=rng.randrange(10**6))["p"] < 0.05
    assert rejections / trials < 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)


def test_mcnemar_exact():
    a = [True] * 10 + [False] * 10 + [True] * 5
    b = [False] * 10 + [False] * 10 + [True] * 5
    r = S.mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"], r["both"], r["neither"]) == (10, 0, 5, 10)
    assert r["p"] == pytest.approx(2 / 1024) and r["difference"] == pytest.approx(10 / 25)
    with pytest.raises(ValueError, match="same units"):
        S.mcnemar_exact([True], [True, False])


def test_holm_known_values():
    adj = S.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adj == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    assert S.holm({"x": 0.6, "y": 0.9}) == pytest.approx({"x": 1.0, "y": 1.0})
    with pytest.raises(ValueError, match="'x'"):
        S.holm({"x": 1.5})


def test_intervals():
    lo, hi = S.wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert S.wilson_interval(0, 20)[0] == 0.0
    ci = S.bootstrap_ci([1.0, 2.0, 3.0, 4.0], seed=0)
    assert 1.0 <= ci[0] < 2.5 < ci[1] <= 4.0
    assert S.bootstrap_ci([1.0]) is None
    assert S.paired_bootstrap_ci([2.0, 3.0, 4.0], [1.0, 2.0, 3.0]) == (1.0, 1.0)


def test_power_paired_matches_seeds_needed():
    from megatron_pdm.analysis.power import seeds_needed

    n = seeds_needed(0.5, 1.0)["t_test"]            # 34 seeds for d = 0.5 at power 0.8
    assert S.power_paired(0.5, 1.0, n) >= 0.8 > S.power_paired(0.5, 1.0, n - 2)
