"""Across-seed summary: pooled vs mean rates, paired wins, sign test, bootstrap intervals."""

from __future__ import annotations

import math

import pytest

from megatron_pdm.analysis.criteria import build_criteria
from megatron_pdm.analysis.summary import bootstrap_mean_ci, sign_test_p, summarize
from megatron_pdm.config import PolicyLossConfig


def _seed(unsafe_ratio, kept_ratio, unsafe_pdm, kept_pdm):
    def entry(unsafe, kept, dis):
        return {"divergence": "topk_kl", "delta": 0.15, "n_out_of_region": kept + 2,
                "n_kept_out_of_region": kept, "n_masked_out_of_region": 2,
                "n_unsafe_kept": unsafe, "n_shrink_kept": kept - unsafe, "own_sign_correct": 3,
                "own_sign_decided": 4, "n_disagree": dis, "n_disagree_out_of_region": dis}
    return {"criteria": {"ratio": entry(unsafe_ratio, kept_ratio, None),
                         "pdm-agg": entry(unsafe_pdm, kept_pdm, 1)}, "prediction": {}}


def test_pooled_mean_and_paired_wins():
    seeds = [_seed(5, 10, 4, 10), _seed(1, 2, 1, 2), _seed(3, 10, 4, 10), _seed(2, 4, 0, 0)]
    crit = build_criteria(("ratio", "pdm-agg"), PolicyLossConfig.preset("pdm-agg"),
                          delta_kl=0.15, delta_tv=0.2)
    s = summarize(seeds, crit)
    r, p = s["criteria"]["ratio"]["unsafe_keep_rate"], s["criteria"]["pdm-agg"]["unsafe_keep_rate"]
    assert r["pooled"] == pytest.approx(11 / 26)
    assert r["mean"] == pytest.approx((0.5 + 0.5 + 0.3 + 0.5) / 4)
    assert p["per_seed"] == [0.4, 0.5, 0.4, None]  # seed 4 keeps nothing out of region
    assert p["pooled"] == pytest.approx(9 / 22) and p["seeds"] == 3
    (pair,) = s["paired"]
    assert (pair["wins"], pair["losses"], pair["ties"], pair["seeds"]) == (1, 1, 1, 3)
    assert pair["mean_difference"] == pytest.approx((-0.1 + 0.0 + 0.1) / 3)
    assert pair["per_seed_difference"][3] is None
    assert s["criteria"]["pdm-agg"]["mean_n_disagree"] == 1


def test_sign_test_exact_values():
    assert sign_test_p(0, 0) is None
    assert sign_test_p(5, 0) == pytest.approx(2 / 32)
    assert sign_test_p(3, 3) == 1.0
    # The paper's 38 wins of 61 seeds, if the other 23 were losses.
    want = 2 * sum(math.comb(61, i) for i in range(24)) / 2 ** 61
    assert sign_test_p(38, 23) == pytest.approx(want) and 0.07 < want < 0.075


def test_bootstrap_is_reproducible_and_brackets_the_mean():
    values = [0.1, -0.3, 0.25, 0.0, -0.05, 0.4, -0.2]
    ci = bootstrap_mean_ci(values, seed=3)
    assert ci == bootstrap_mean_ci(values, seed=3)
    assert ci[0] < sum(values) / len(values) < ci[1]
    assert bootstrap_mean_ci([0.2], seed=0) is None
    assert bootstrap_mean_ci([0.2, 0.2, 0.2], seed=0) == (pytest.approx(0.2), pytest.approx(0.2))
