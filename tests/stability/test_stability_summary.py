"""The stability benchmark's pre-registered collapse flag and its paired comparisons."""

from __future__ import annotations

import math

import pytest

from megatron_pdm import metrics as M
from megatron_pdm.stability import summary as S
from megatron_pdm.stability.grid import Grid


def _rows(rewards, grad=1.0):
    return [{M.ITERATION: i, M.REWARD_MEAN: r, M.GRAD_NORM: grad, M.LOSS_PG: 0.1}
            for i, r in enumerate(rewards)]


def test_collapse_fires_on_each_reason_and_not_otherwise():
    steady = _rows([0.3] * 12)
    assert not S.collapse(steady, S.curves(steady), 0.3, 0.35)["collapsed"]
    falling = _rows([0.3] * 6 + [0.05] * 6)
    assert S.collapse(falling, S.curves(falling), 0.3, 0.3)["collapsed"]
    assert S.collapse(steady, S.curves(steady), 0.3, 0.15)["collapsed"]  # accuracy drop
    nan = _rows([0.3] * 12, grad=float("nan"))
    out = S.collapse(nan, S.curves(nan), 0.3, 0.3)
    assert out["collapsed"] and "non-finite" in out["reasons"][0]


def _record(method, seed, acc):
    return {"cell": f"{method}__base__s{seed}", "method": method, "setting": "base",
            "seed": seed, "end": {"greedy_acc_after_rl": acc, "reward_end": acc}}


def test_compare_is_paired_and_holm_adjusted():
    recs = [_record("no-trust-region", s, 0.2 + 0.01 * s) for s in range(8)]
    recs += [_record("pdm-agg", s, 0.5 + 0.01 * s) for s in range(8)]
    recs += [_record("grpo-clip-higher", s, 0.2 + 0.01 * s + (0.01 if s % 2 else -0.01))
             for s in range(8)]
    rows = {(r["method"], r["outcome"]): r for r in S.compare(recs, baseline="no-trust-region",
                                                               resamples=2000)}
    win = rows[("pdm-agg", "greedy_acc_after_rl")]
    assert math.isclose(win["mean_diff"], 0.3) and win["n_seeds"] == 8
    assert win["ci95"][0] > 0 and win["verdict"] == "higher" and win["p_holm"] >= win["p"]
    assert rows[("grpo-clip-higher", "greedy_acc_after_rl")]["verdict"] == "no difference"


def test_grid_cells_seed_major_and_checked():
    g = Grid(["no-trust-region", "pdm-agg"], ["base", "stale2"], [1, 2])
    cells = g.cells()
    assert len(cells) == 8 and [c.seed for c in cells[:4]] == [1] * 4
    assert "rollout.local.staleness=2" in g.overrides(cells[2]) or "rollout.local.staleness=2" in \
        g.overrides(cells[3])
    try:
        Grid(["nope"], ["base"], [1])
    except ValueError as err:
        assert "nope" in str(err)
    else:
        raise AssertionError("unknown method accepted")


def test_too_few_seeds_is_undecided_not_no_difference():
    """2 seeds: the sign-flip p is at least 0.5, so the row cannot say 'no difference'."""
    recs = [_record("no-trust-region", s, 0.2) for s in range(2)]
    recs += [_record("pdm-agg", s, 0.4) for s in range(2)]
    rows = S.compare(recs, baseline="no-trust-region", resamples=200)
    assert rows and all(r["verdict"].startswith("undecided") for r in rows)
    assert all(r["p_holm_floor"] == 1.0 for r in rows)


def test_primary_outcome_is_its_own_holm_family():
    # 8 seeds, one method clearly higher on both outcomes: with a primary outcome the primary
    # family has 1 row (Holm p = raw p), the secondary family holds the other
    recs = []
    for seed in range(1, 9):
        recs.append(_record("no-trust-region", seed, 0.10))
        recs.append(_record("pdm-agg", seed, 0.10 + 0.01 * seed))
    one = {r["outcome"]: r for r in S.compare(recs, baseline="no-trust-region", resamples=500)}
    two = {r["outcome"]: r for r in S.compare(recs, baseline="no-trust-region", resamples=500,
                                               primary="greedy_acc_after_rl")}
    assert {r["family"] for r in one.values()} == {"all"}
    assert two["greedy_acc_after_rl"]["family"] == "primary"
    assert two["reward_end"]["family"] == "secondary"
    assert two["greedy_acc_after_rl"]["p_holm"] == two["greedy_acc_after_rl"]["p"]
    assert one["greedy_acc_after_rl"]["p_holm"] > one["greedy_acc_after_rl"]["p"]
    with pytest.raises(ValueError, match="primary outcome"):
        S.compare(recs, baseline="no-trust-region", outcomes=("reward_end",),
                  primary="greedy_acc_after_rl")
    with pytest.raises(ValueError, match="unknown outcome"):
        S.compare(recs, baseline="no-trust-region", outcomes=("accuracy",))


def test_greedy_by_iteration_orders_the_evaluations_and_the_table_prints_them():
    from megatron_pdm.train import report

    evals = {"before_warmup": 0.1, "before_rl": 0.2, "rl_iter8": 0.3, "rl_iter4": 0.25,
             "after_rl": 0.35, "warmup_steps": 40.0}
    by_it = report.greedy_by_iteration(evals, 12)
    assert list(by_it.items()) == [("0", 0.2), ("4", 0.25), ("8", 0.3), ("12", 0.35)]
    assert report.greedy_by_iteration({"before_rl": 0.2}, 3) == {"0": 0.2}
    row = [r for r in report.format_table({"greedy_acc_by_iteration": by_it}).splitlines()
           if r.startswith("| greedy_acc_by_iteration")]
    assert row == ["| greedy_acc_by_iteration | 0: 0.200, 4: 0.250, 8: 0.300, 12: 0.350 |"]


def test_stability_plot_has_the_greedy_panel_only_with_mid_run_evaluations(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from megatron_pdm.stability import report as srep

    titles: list[str] = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: titles.extend(
        ax.get_title() for ax in fig.axes))
    curves = {k: [0.1, 0.2, 0.3] for k in ("reward", "sampled_kl_first_step", "entropy",
                                          "grad_norm")}
    rec = {"setting": "base", "method": "pdm-agg", "curves": curves,
           "greedy_by_iteration": {"0": 0.2, "3": 0.3}}
    srep.plot([rec], str(tmp_path / "a.png"))
    assert not any("greedy" in t for t in titles)
    titles.clear()
    srep.plot([dict(rec, greedy_by_iteration={"0": 0.2, "1": 0.25, "2": 0.2, "3": 0.3})],
              str(tmp_path / "b.png"))
    assert "base: " + srep.GREEDY in titles


def test_in_words_says_what_the_tables_say():
    from megatron_pdm.stability import report

    cell = {"setting": "epochs16", "seeds": [1, 2, 3], "collapsed": 0, "masked_frac_end": 0.0}
    result = {
        "outcomes": ["greedy_acc_after_rl"],
        "cells": [{**cell, "method": "no-trust-region", "collapsed": 2},
                  {**cell, "method": "pdm-agg", "masked_frac_end": 0.2},
                  {**cell, "method": "grpo-clip-higher", "masked_frac_end": 0.009},
                  {**cell, "setting": "base", "method": "pdm-agg"}],
        "comparisons": [
            {"setting": "epochs16", "outcome": "greedy_acc_after_rl", "method": "pdm-agg",
             "baseline": "no-trust-region", "verdict": "higher"},
            {"setting": "epochs16", "outcome": "greedy_acc_after_rl",
             "method": "grpo-clip-higher", "baseline": "no-trust-region",
             "verdict": "no difference"}],
    }
    lines = report.in_words(result)
    epochs16 = next(line for line in lines if "**epochs16**" in line)
    assert "vs no-trust-region: higher: pdm-agg; no difference: grpo-clip-higher" in epochs16
    assert ">= 0.01: pdm-agg." in epochs16  # 0.009 is below the line
    assert "collapsed: no-trust-region 2/3." in epochs16
    base = next(line for line in lines if "**base**" in line)
    assert "no method" in base and "collapsed: no run" in base
