"""End-of-run outputs: the PNG plot and the summary table (printed on rank 0 and saved).

Plot panels (x = optimizer step; trailing moving average over ~1/40 of the run): mean rollout
reward; masked fraction overall and by advantage sign; mean |pi_k - mu_k| and mean
|log pi_k - log mu_k| (train/rollout mismatch); top-K KL / TV between the training policy and the
rollout support.

Summary: RL reward at the start (mean of the first `window` iterations) and at the end (last
`window`), greedy held-out accuracy before the warm-up, after it (= before RL) and after RL, the
mean masked fraction and mismatch, and the wall time. The warm-up is never counted as RL gain.
"""

from __future__ import annotations

import json
import logging
import math
import os

from megatron_pdm.train.logging_utils import read_metrics

logger = logging.getLogger(__name__)

PANELS = (
    ("reward", ("reward/mean",)),
    ("masked fraction", ("pdm/masked_frac", "pdm/masked_frac_pos_adv", "pdm/masked_frac_neg_adv")),
    ("train/rollout mismatch", ("pdm/abs_prob_diff", "mismatch/abs_logprob_diff")),
    ("top-K divergence", ("pdm/topk_kl_mean", "pdm/topk_tv_mean")),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average (window 1 returns the input)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_runs(runs: dict[str, list[dict]], path: str, title: str = "") -> str:
    """One figure, one panel per PANELS entry, one line per (run, key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8))
    for ax, (name, keys) in zip(axes, PANELS):
        for label, rows in runs.items():
            for key in keys:
                xs, ys = _series(rows, key)
                ys = _smooth(ys, max(1, len(ys) // 40))  # per-step values are noisy
                if xs:
                    tag = key.split("/")[-1] if len(keys) > 1 else ""
                    ax.plot(xs, ys, label=" ".join(t for t in (label, tag) if t), lw=1.2)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        if name != "reward":
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def iteration_rewards(rows: list[dict]) -> list[float]:
    seen, out = set(), []
    for r in rows:
        if r["iteration"] not in seen:
            seen.add(r["iteration"])
            out.append(r["reward/mean"])
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict], evals: dict, wall_s: float, window: int = 10) -> dict:
    rewards = iteration_rewards(rows)
    w = max(1, min(window, len(rewards) // 2 or 1))
    return {
        "iterations": len(rewards),
        "optimizer_steps": len(rows),
        "rl_reward_initial": _mean(rewards[:w]),
        "rl_reward_final": _mean(rewards[-w:]),
        "reward_window_iterations": w,
        "greedy_acc_before_warmup": evals.get("before_warmup", float("nan")),
        "greedy_acc_before_rl": evals.get("before_rl", float("nan")),
        "greedy_acc_after_rl": evals.get("after_rl", float("nan")),
        "masked_frac_mean": _mean([r.get("pdm/masked_frac") for r in rows]),
        "abs_prob_diff_mean": _mean([r.get("pdm/abs_prob_diff") for r in rows]),
        "abs_logprob_diff_mean": _mean([r.get("mismatch/abs_logprob_diff") for r in rows]),
        "wall_s": wall_s,
    }


def format_table(summary: dict) -> str:
    lines = ["| metric | value |", "|---|---|"]
    for k, v in summary.items():
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return "\n".join(lines)


def finish(cfg, evals: dict, wall_s: float) -> dict:
    """Rank 0: plot, summary.json, summary.md; prints the table. Returns the summary."""
    rows = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    summary = summarize(rows, evals, wall_s)
    summary["preset"] = cfg.loss.name or "custom"
    if cfg.log.plot and rows:
        plot_runs({summary["preset"]: rows}, os.path.join(cfg.output_dir, "plot.png"),
                  title=f"{summary['preset']} (seed {cfg.seed})")
    table = format_table(summary)
    with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(cfg.output_dir, "summary.md"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)  # the CLI's summary table (rank 0)
    return summary
