"""analysis/learning.py + tools/learning_report: the seeds' held-out gain, paired by problem."""

from __future__ import annotations

import json
import os

import pytest

from megatron_pdm.analysis import learning
from megatron_pdm.tools import learning_report as cli
from megatron_pdm.train import evaluation as ev

PROBLEMS = list(range(100, 110))


def _run(tmp_path, seed, before, after, *, problems=PROBLEMS, sampled=True):
    d = tmp_path / f"seed{seed}"
    d.mkdir()
    for name, it, g in (("before_rl", 0, before), ("after_rl", 2, after)):
        ev.append_record(str(d), ev.EvalRecord(
            name, it, list(problems), [float(x) for x in g],
            [float(x) / 2 for x in g] if sampled else None, 1 if sampled else 0,
            {"responses": 4, "reproduced_frac": 1.0}))
    with open(d / "metrics.jsonl", "w") as f:
        for it in range(2):
            f.write(json.dumps({"iteration": it, "step": it, "reward/mean": 0.1 * (it + seed),
                                "time/iteration_s": 60.0 + it, "time/rollout_s": 20.0}) + "\n")
    with open(d / "summary.json", "w") as f:
        json.dump({"seed": seed, "preset": "pdm-agg", "wall_s": 123.0}, f)
    return str(d)


def test_pooled_gain_is_the_mean_of_the_seeds_paired_by_problem(tmp_path):
    a = _run(tmp_path, 1, [0] * 10, [1, 1, 1, 0, 0, 0, 0, 0, 0, 0])   # +0.3
    b = _run(tmp_path, 2, [1, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1] * 5 + [0] * 5)  # +0.4
    out = tmp_path / "report"
    res = learning.learning_report([a, b], str(out), plot_png=False)
    g = res["pooled"]["greedy"]
    assert g["gain"] == pytest.approx(0.35)
    assert g["start_acc"] == pytest.approx(0.05) and g["end_acc"] == pytest.approx(0.4)
    lo, hi = g["bootstrap_ci95_descriptive"]
    assert lo <= 0.35 <= hi and lo > 0
    assert res["pooled"]["sampled"]["gain"] == pytest.approx(0.175)
    assert [s["heldout"]["gain"]["greedy"]["gain"] for s in res["seeds"]] == pytest.approx(
        [0.3, 0.4])
    assert res["seeds"][0]["median_times"]["time/iteration_s"] == pytest.approx(60.5)
    assert res["seeds"][1]["reward"] == pytest.approx([0.2, 0.3])
    md = (out / "results.md").read_text()
    assert "**pooled greedy**" in md and "+0.350" in md
    assert json.loads((out / "results.json").read_text())["pooled"]["problems"] == 10


def test_no_gain_gives_an_interval_with_zero(tmp_path):
    same = [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    flipped = [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]
    a = _run(tmp_path, 1, same, flipped, sampled=False)
    res = learning.learning_report([a], str(tmp_path / "r"), plot_png=False)
    g = res["pooled"]["greedy"]
    assert g["gain"] == 0 and g["bootstrap_ci95_descriptive"][0] < 0 < g[
        "bootstrap_ci95_descriptive"][1]
    assert "sampled" not in res["pooled"]


def test_runs_that_cannot_pair_are_refused_with_the_reason(tmp_path, capsys):
    a = _run(tmp_path, 1, [0] * 10, [1] * 10)
    b = _run(tmp_path, 2, [0] * 10, [1] * 10, problems=list(range(10)))
    assert cli.main([a, b, "--out", str(tmp_path / "r"), "--no-plot"]) == 2
    assert "held-out problems differ" in capsys.readouterr().err
    dup = _run(tmp_path, 3, [0] * 10, [1] * 10)
    with open(os.path.join(dup, "summary.json"), "w") as f:
        json.dump({"seed": 1}, f)  # a second run of seed 1
    assert cli.main([a, dup, "--out", str(tmp_path / "r"), "--no-plot"]) == 2
    assert "share a seed" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "missing"), "--out", str(tmp_path / "r")]) == 2
    assert "no summary.json" in capsys.readouterr().err


def test_plot_is_written(tmp_path):
    a = _run(tmp_path, 1, [0] * 10, [1] * 10)
    learning.learning_report([a], str(tmp_path / "r"))
    assert os.path.getsize(tmp_path / "r" / "curves.png") > 1000


def test_a_monte_carlo_p_at_its_floor_is_printed_as_a_bound():
    floor = 1 / (1 + learning.SIGN_FLIP_RESAMPLES)
    assert learning._fmt_p({"sign_flip_p": floor, "sign_flip_exact": False}).startswith(
        "sign-flip p < 1e-04")
    assert learning._fmt_p({"sign_flip_p": 0.03, "sign_flip_exact": False}) == "sign-flip p 0.03"
    # an exact enumeration's p is a value, even when small
    assert learning._fmt_p({"sign_flip_p": 2 ** -12, "sign_flip_exact": True}) == (
        "sign-flip p 0.00024")
