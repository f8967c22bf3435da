"""Plots a user can read: labelled axes, smoothed curves over faint raw ones, and a compare plot
that stays readable with many runs (one line per run per panel, one legend outside the panels).

The figure is captured at `savefig` (the plotting entry point the driver and compare call), from
synthetic metrics rows with the driver's shape: 4 optimizer steps per iteration, a noisy reward
and a masked fraction that saw-tooths within each iteration (step 0 on-policy, later steps
stale).
"""

from __future__ import annotations

import itertools
import random

import pytest

matplotlib = pytest.importorskip("matplotlib")


def _rows(seed: int, iterations: int = 120) -> list[dict]:
    rng = random.Random(seed)
    rows, step = [], 0
    for it in range(iterations):
        reward = min(1.0, 0.3 + 0.004 * it + rng.gauss(0, 0.12))
        for j in range(4):
            step += 1
            rows.append({"step": step, "iteration": it, "minibatch": j, "reward/mean": reward,
                         "pdm/masked_frac": 0.02 * j + rng.random() * 0.002,
                         "pdm/masked_frac_pos_adv": 0.01 * j, "pdm/masked_frac_neg_adv": 0.03 * j,
                         "mismatch/abs_logprob_diff": 0.04 + 0.01 * j,
                         "pdm/abs_prob_diff": 0.01 + 0.002 * j,
                         "pdm/topk_kl_mean": 1e-3 * (1 + j), "pdm/topk_tv_mean": 1e-2 * (1 + j)})
    return rows


@pytest.fixture
def captured(monkeypatch):
    import matplotlib.figure

    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figs.append(self))
    return figs


def _variation(ys) -> float:
    return sum(abs(b - a) for a, b in itertools.pairwise(ys))


def test_run_plot_has_labelled_axes_and_smoothed_reward(captured, tmp_path):
    from megatron_pdm.train.report import plot_runs

    plot_runs({"pdm-agg": _rows(0)}, str(tmp_path / "plot.png"), title="pdm-agg (seed 0)",
              evals={"before_rl": 0.3, "after_rl": 0.7})
    (fig,) = captured
    axes = [ax for ax in fig.axes if ax.get_lines()]
    assert len(axes) == 4
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
    reward = next(ax for ax in axes if "reward" in ax.get_title())
    faint = [ln for ln in reward.get_lines() if (ln.get_alpha() or 1) < 0.5]
    solid = [ln for ln in reward.get_lines() if (ln.get_alpha() or 1) == 1 and len(ln.get_xdata()) > 2]
    assert faint and solid, "raw (faint) and smoothed reward curves"
    assert _variation(solid[0].get_ydata()) < 0.3 * _variation(faint[0].get_ydata())


def test_compare_plot_stays_readable_with_many_runs(captured, tmp_path):
    from megatron_pdm.train.report import plot_runs

    runs = {f"{p}_s{s}": _rows(10 * s + i) for i, p in enumerate(
        ("grpo", "dppo-topk-kl", "pdm-agg", "drpo")) for s in (1, 2)}
    plot_runs(runs, str(tmp_path / "compare.png"), title="presets x seeds")
    (fig,) = captured
    axes = [ax for ax in fig.axes if ax.get_lines()]
    assert len(axes) == 4
    for ax in axes:
        assert ax.get_legend() is None, f"legend inside the {ax.get_title()!r} panel"
        assert len(ax.get_lines()) <= len(runs), ax.get_title()  # one line per run
        assert ax.get_xlabel() and ax.get_ylabel()
    assert fig.legends and len(fig.legends[0].get_texts()) == len(runs)
    masked = next(ax for ax in axes if "masked" in ax.get_title())
    for line in masked.get_lines():  # per-iteration means: no within-iteration saw-tooth
        ys = list(line.get_ydata())
        assert _variation(ys) < 0.1, _variation(ys)
