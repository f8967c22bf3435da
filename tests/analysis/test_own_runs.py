"""Design "runs": the per-step counts of one criterion's run pool into one rate per run, and
the CLI's power analysis chooses the seeds."""

from __future__ import annotations

import json

import pytest

from megatron_pdm.analysis.criteria import build_criteria
from megatron_pdm.analysis.own_runs import pool_steps
from megatron_pdm.analysis.report import markdown
from megatron_pdm.analysis.summary import summarize
from megatron_pdm.config import PolicyLossConfig


def _step(kept, unsafe, shrink, sum_dd, mom_unsafe):
    return {"divergence": "topk_kl", "delta": 0.05, "n_out_of_region": kept + 1,
            "n_kept_out_of_region": kept, "n_masked_out_of_region": 1, "n_unsafe_kept": unsafe,
            "n_shrink_kept": shrink, "n_flat_kept": kept - unsafe - shrink,
            "unsafe_keep_rate": unsafe / kept if kept else None,
            "sum_delta_d_kept_out_of_region": sum_dd, "own_sign_correct": 2,
            "own_sign_decided": 3, "n_disagree": None, "n_unsafe_kept@momentum": mom_unsafe,
            "n_shrink_kept@momentum": kept - mom_unsafe,
            "sum_delta_d_kept_out_of_region@momentum": 0.5, "own_sign_correct@momentum": 1,
            "own_sign_decided@momentum": 3}


def test_pooled_rates_weigh_every_kept_token_of_the_run_equally():
    p = pool_steps([_step(4, 1, 3, -0.2, 4), _step(0, 0, 0, 0.0, 0), _step(6, 6, 0, 0.6, 5)])
    assert p["steps"] == 3 and p["n_kept_out_of_region"] == 10 and p["n_unsafe_kept"] == 7
    assert p["unsafe_keep_rate"] == pytest.approx(0.7)  # not the mean of 0.25 and 1.0
    assert p["shrink_share"] == pytest.approx(0.3)
    assert p["mean_delta_d_kept_out_of_region"] == pytest.approx(0.04)
    assert p["unsafe_keep_rate@momentum"] == pytest.approx(0.9)
    assert p["mean_delta_d_kept_out_of_region@momentum"] == pytest.approx(0.15)
    assert p["own_sign_accuracy"] == pytest.approx(6 / 9)
    assert "n_disagree" not in p  # None in the steps: not a count to add
    with pytest.raises(ValueError, match="no steps"):
        pool_steps([])


def test_the_controls_stand_beside_the_rate_in_the_report():
    crit = build_criteria(("ratio", "pdm-agg"), PolicyLossConfig.preset("pdm-agg"),
                          delta_kl=0.05, delta_tv=0.2)
    seed = {"criteria": {n: pool_steps([_step(4, 1, 3, -0.2, 4)]) for n in ("ratio", "pdm-agg")},
            "prediction": {}}
    s = summarize([seed, seed], crit)
    assert s["criteria"]["ratio"]["unsafe_keep_rate@momentum"]["pooled"] == 1.0
    md = markdown({"design": "runs", "steps_per_run": 8, "sgd_lr": 1e-4,
                   "power": {"t_test": 40, "normal": 38, "effect": -0.027, "sd": 0.059,
                             "alpha": 0.05, "power": 0.8, "sd_source": "stated"}}, s)
    assert "| ratio | 25.0% / 100.0% / n/a |" in md
    assert "own training run" in md and "Seeds from the power analysis" in md


def test_cli_power_analysis_chooses_the_seeds(tmp_path):
    from megatron_pdm.configtree import ConfigError
    from megatron_pdm.tools.analyze_masks import _power, _seeds, parse_args

    a = parse_args(["--out-dir", "o", "--power-effect", "-0.027", "--power-sd", "0.059"])
    assert _power(a)["t_test"] == 40
    pilot = tmp_path / "results.json"
    pilot.write_text(json.dumps({"setup": {"seeds": [1, 2, 3]}, "summary": {"paired": [
        {"criterion": "pdm-agg", "per_seed_difference": [0.0, 0.1, -0.1]}]}}))
    a = parse_args(["--out-dir", "o", "--power-effect", "-0.05", "--pilot", str(pilot)])
    got = _power(a, "pdm-agg")
    assert got["sd"] == pytest.approx(0.1) and "pilot" in got["sd_source"]
    assert got["pilot_seeds"] == [1, 2, 3]
    a = parse_args(["--out-dir", "o", "--power-effect", "-0.05", "--pilot", str(pilot),
                    "--first-seed", "101"])
    assert _seeds(a, _power(a))[:2] == [101, 102] and len(_seeds(a, _power(a))) == _power(a)["t_test"]
    with pytest.raises(ConfigError, match="exactly one"):
        _power(parse_args(["--out-dir", "o", "--power-effect", "-0.05"]))
