"""Across-seed summary: pooled vs mean rates, seeds without a rate counted, paired wins, the
sign and sign-flip tests, Holm, the primary comparison, the descriptive bootstrap."""

from __future__ import annotations

import math
import statistics

import pytest

from megatron_pdm import significance
from megatron_pdm.analysis.criteria import build_criteria
from megatron_pdm.analysis.summary import sign_test_p, summarize
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
    # pooled counts with their Wilson interval; the seed without a rate is counted, not lost
    assert (p["k"], p["n"], p["n_seeds_no_rate"]) == (9, 22, 1)
    assert p["wilson95"] == pytest.approx(significance.wilson_interval(9, 22))
    assert r["n_seeds_no_rate"] == 0
    (pair,) = s["paired"]
    assert (pair["wins"], pair["losses"], pair["ties"], pair["seeds"]) == (1, 1, 1, 3)
    assert (pair["n_seeds_run"], pair["n_seeds_entered"]) == (4, 3)
    assert pair["n_seeds_no_rate"] == {"criterion": 1, "baseline": 0, "either": 1}
    assert pair["mean_difference"] == pytest.approx((-0.1 + 0.0 + 0.1) / 3)
    assert pair["per_seed_difference"][3] is None
    assert pair["sign_flip_p"] == pytest.approx(1.0) and pair["sign_test_p"] == 1.0
    assert pair["p_floor"] == 0.5 and pair["verdict"].startswith("undecided")
    assert s["criteria"]["pdm-agg"]["mean_n_disagree"] == 1
    assert s["primary"] is None and not pair["primary"]


def _crit4():
    return build_criteria(("ratio", "pdm-agg", "pdm-exact"), PolicyLossConfig.preset("pdm-agg"),
                          delta_kl=0.15, delta_tv=0.2)


def _seed3(r, a, e):
    seed = _seed(r, 10, a, 10)
    seed["criteria"]["pdm-exact"] = dict(seed["criteria"]["pdm-agg"], n_unsafe_kept=e,
                                         n_shrink_kept=10 - e)
    return seed


def test_holm_over_every_comparison_and_the_primary_is_marked():
    # pdm-agg lower on 12 of 12 seeds, pdm-exact tied with ratio on all
    seeds = [_seed3(6, 3, 6) for _ in range(12)]
    s = summarize(seeds, _crit4(), primary="pdm-agg:ratio")
    rows = {r["criterion"]: r for r in s["paired"]}
    agg, exact = rows["pdm-agg"], rows["pdm-exact"]
    assert agg["primary"] and not exact["primary"]
    assert s["primary"] == "pdm-agg:ratio:unsafe_keep_rate"
    assert agg["family_size"] == 2
    assert agg["sign_flip_p"] == pytest.approx(2 / 2 ** 12)  # exact: all same sign
    assert agg["sign_test_p"] == pytest.approx(2 / 2 ** 12)
    assert agg["p_holm"] == pytest.approx(2 * agg["sign_flip_p"])
    assert agg["verdict"] == "lower" and exact["verdict"].startswith("undecided")
    assert exact["p_holm"] == 1.0
    # a primary outside the comparisons of the defaults is added to the family
    s = summarize(seeds, _crit4(), primary="pdm-exact:pdm-agg")
    assert len(s["paired"]) == 3 and s["paired"][0]["primary"]
    assert s["paired"][0]["verdict"] == "higher"
    with pytest.raises(ValueError, match="not among the study's criteria"):
        summarize(seeds, _crit4(), primary="pdm-uniform:ratio")


def test_power_check_sets_the_measured_sd_beside_the_assumed_one():
    seeds = [_seed3(6, 3 + (k % 3), 6) for k in range(12)]
    power = {"effect": -0.027, "sd": 0.059, "t_test": 40, "sd_source": "stated"}
    s = summarize(seeds, _crit4(), primary="pdm-agg:ratio", power=power)
    pc = s["power_check"]
    diffs = s["paired"][0]["per_seed_difference"]
    assert pc["sd_measured"] == pytest.approx(statistics.stdev(diffs))
    assert pc["sd_assumed"] == 0.059 and pc["n_seeds_entered"] == 12
    assert pc["power_at_assumed_sd"] == pytest.approx(
        significance.power_paired(-0.027, 0.059, 12))


def test_sign_test_exact_values():
    assert sign_test_p(0, 0) is None
    assert sign_test_p(5, 0) == pytest.approx(2 / 32)
    assert sign_test_p(3, 3) == 1.0
    # The paper's 38 wins of 61 seeds, if the other 23 were losses.
    want = 2 * sum(math.comb(61, i) for i in range(24)) / 2 ** 61
    assert sign_test_p(38, 23) == pytest.approx(want) and 0.07 < want < 0.075


def test_the_descriptive_bootstrap_is_significance_bootstrap_ci():
    seeds = [_seed(5, 10, 4, 10), _seed(1, 2, 1, 2), _seed(3, 10, 4, 10), _seed(2, 4, 0, 0)]
    crit = build_criteria(("ratio", "pdm-agg"), PolicyLossConfig.preset("pdm-agg"),
                          delta_kl=0.15, delta_tv=0.2)
    s = summarize(seeds, crit, bootstrap_seed=3)
    (pair,) = s["paired"]
    diffs = [d for d in pair["per_seed_difference"] if d is not None]
    assert pair["bootstrap_ci95_descriptive"] == significance.bootstrap_ci(diffs, seed=3)
    assert summarize(seeds, crit, bootstrap_seed=3) == s  # reproducible bit for bit
