"""End-of-run outputs: the PNG plot and the summary table (printed on rank 0 and saved).

Plot panels, x = RL iteration (per-step metrics are averaged over the iteration's optimizer
steps first: later steps of an iteration are off-policy, so per-step curves saw-tooth): the
rollouts' mean sampled reward (with the greedy held-out accuracy before and after RL as markers);
the masked fraction (single run: overall, A>0 and A<0); mean |pi_k - mu_k| and
|log pi_k - log mu_k| (train/rollout mismatch); top-K KL / TV between the training policy and
the rollout support. Each series is drawn raw (faint) with a centred moving average over ~1/10 of
the run on top. With many runs (`compare`) each panel shows one smoothed line per run for its
first metric, the raw lines only up to 3 runs, and one legend under the panels.

Summary: RL reward at the start (mean of the first `window` iterations) and at the end (last
`window`), greedy held-out accuracy before the warm-up, after it (= before RL) and after RL, the
mean masked fraction and mismatch, and the wall time. The warm-up is never counted as RL gain.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch

from megatron_pdm import hostinfo
from megatron_pdm.train import evaluation
from megatron_pdm.train.logging_utils import read_metrics

logger = logging.getLogger(__name__)

# (title, y-axis label, metric keys); the first key is the one compare plots show.
PANELS = (
    ("sampled reward", "mean reward of the iteration's rollouts", ("reward/mean",)),
    ("masked fraction", "fraction of A != 0 tokens masked",
     ("pdm/masked_frac", "pdm/masked_frac_pos_adv", "pdm/masked_frac_neg_adv")),
    ("train/rollout mismatch", "mean per token", ("mismatch/abs_logprob_diff",
                                                  "pdm/abs_prob_diff")),
    ("top-K divergence", "mean per token", ("pdm/topk_kl_mean", "pdm/topk_tv_mean")),
)
_LABELS = {"reward/mean": "reward", "pdm/masked_frac": "all", "pdm/masked_frac_pos_adv": "A>0",
           "pdm/masked_frac_neg_adv": "A<0", "mismatch/abs_logprob_diff": "|log pi - log mu|",
           "pdm/abs_prob_diff": "|pi - mu|", "pdm/topk_kl_mean": "top-K KL",
           "pdm/topk_tv_mean": "top-K TV"}
MAX_RAW_RUNS = 3


def per_iteration(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(iterations, mean of `key` over each iteration's optimizer steps), finite values only."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        v = r.get(key)
        if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
            sums.setdefault(int(r["iteration"]), []).append(float(v))
    xs = sorted(sums)
    return xs, [sum(sums[x]) / len(sums[x]) for x in xs]


def smooth(ys: list[float], window: int) -> list[float]:
    """Centred moving average (the window shrinks at the ends; window 1 returns the input)."""
    half = max(0, window // 2)
    out = []
    for i in range(len(ys)):
        lo, hi = max(0, i - half), min(len(ys), i + half + 1)
        out.append(sum(ys[lo:hi]) / (hi - lo))
    return out


def figure(runs: dict[str, list[dict]], title: str = "", evals: dict | None = None):
    """The matplotlib figure of `runs` (label -> metrics rows); see the module docstring."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(runs) > 1
    colors = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.2 if many else 7.6))
    for ax, (name, ylabel, keys) in zip(axes.flat, PANELS):
        shown = keys[:1] if many else keys
        for i, (label, rows) in enumerate(runs.items()):
            for j, key in enumerate(shown):
                xs, ys = per_iteration(rows, key)
                if not xs:
                    continue
                color = colors(i % colors.N) if many else colors(j)
                if len(runs) <= MAX_RAW_RUNS:
                    ax.plot(xs, ys, color=color, lw=0.8, alpha=0.25)
                ax.plot(xs, smooth(ys, max(1, len(ys) // 10)), color=color, lw=1.6,
                        label=label if many else _LABELS.get(key, key))
        if not many and evals and name == "sampled reward":
            _eval_markers(ax, runs, evals)
        ax.set_title(f"{name} ({_LABELS.get(keys[0], keys[0])})" if many and len(keys) > 1
                     else name)
        ax.set_xlabel("RL iteration")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not many and ax.get_lines():
            ax.legend(fontsize=8)
    if many:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))),
                   fontsize=8, frameon=False)
    fig.suptitle(title or "")
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(runs) - 1) // 6) if many else 0, 1, 1))
    return fig


def _eval_markers(ax, runs: dict, evals: dict) -> None:
    xs = [x for rows in runs.values() for x in per_iteration(rows, "reward/mean")[0]]
    if not xs:
        return
    for x, key, text in ((min(xs), "before_rl", "greedy acc before RL"),
                         (max(xs), "after_rl", "greedy acc after RL")):
        v = evals.get(key)
        if v is not None and math.isfinite(v):
            ax.plot([x], [v], marker="D", ms=6, ls="none", color="black")
            ax.annotate(f"{text} {v:.2f}", (x, v), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)


def plot_runs(runs: dict[str, list[dict]], path: str, title: str = "",
              evals: dict | None = None) -> str:
    """Writes `figure(runs, title, evals)` to `path`."""
    import matplotlib.pyplot as plt

    fig = figure(runs, title, evals)
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


def greedy_by_iteration(evals: dict, iterations: int) -> dict[str, float]:
    """RL iteration -> greedy accuracy: "0" before RL, "<k>" after iteration k (the
    `train.eval_interval` evaluations, named "rl_iter<k>"), `iterations` after RL."""
    out = {int(name.removeprefix("rl_iter")): v for name, v in evals.items()
           if name.startswith("rl_iter")}
    if "before_rl" in evals:
        out[0] = evals["before_rl"]
    if "after_rl" in evals:
        out[iterations] = evals["after_rl"]
    return {str(k): out[k] for k in sorted(out)}


def summarize(rows: list[dict], evals: dict, wall_s: float, window: int = 10) -> dict:
    rewards = iteration_rewards(rows)
    w = max(1, min(window, len(rewards) // 2 or 1))
    return {
        "iterations": len(rewards),
        "optimizer_steps": len(rows),
        "rl_reward_initial": _mean(rewards[:w]),
        "rl_reward_final": _mean(rewards[-w:]),
        "reward_window_iterations": w,
        "warmup_steps": int(evals.get("warmup_steps", 0)),
        "warmup_probe_acc": evals.get("warmup_probe_acc", float("nan")),
        "greedy_acc_before_warmup": evals.get("before_warmup", float("nan")),
        "greedy_acc_before_rl": evals.get("before_rl", float("nan")),
        "greedy_acc_after_rl": evals.get("after_rl", float("nan")),
        "greedy_acc_by_iteration": greedy_by_iteration(evals, len(rewards)),
        "masked_frac_mean": _mean([r.get("pdm/masked_frac") for r in rows]),
        "abs_prob_diff_mean": _mean([r.get("pdm/abs_prob_diff") for r in rows]),
        "abs_logprob_diff_mean": _mean([r.get("mismatch/abs_logprob_diff") for r in rows]),
        "wall_s": wall_s,
    }


def format_table(summary: dict) -> str:
    lines = ["| metric | value |", "|---|---|"]
    for k, v in summary.items():
        if isinstance(v, dict):  # greedy_acc_by_iteration: "it: acc, ..."
            v = ", ".join(f"{i}: {a:.3f}" for i, a in v.items()) or "-"
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return "\n".join(lines)


def _ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[-]"


def heldout_lines(heldout: dict) -> str:
    """The held-out gain under the summary table (empty without both ends)."""
    g = heldout.get("gain")
    if not g:
        return ""
    ev_a, ev_b = heldout["evaluations"][g["from"]], heldout["evaluations"][g["to"]]
    out = [f"\nheld-out gain {g['from']} -> {g['to']} on {g['problems']} problems "
           "(paired bootstrap 95%, descriptive):"]
    for kind in ("greedy", "sampled"):
        if kind not in g:
            continue
        d = g[kind]
        p = (f"McNemar p {d['mcnemar_p']:.3g}" if "mcnemar_p" in d
             else f"sign-flip p {d['sign_flip_p']:.3g}")
        out.append(f"  {kind}: {ev_a[kind]['acc']:.3f} -> {ev_b[kind]['acc']:.3f}, gain "
                   f"{d['gain']:+.3f} {_ci(d['paired_bootstrap_ci95'])}, {p}")
    return "\n".join(out)


def finish(cfg, evals: dict, wall_s: float) -> dict:
    """Rank 0: plot, summary.json, summary.md; prints the table. Returns the summary."""
    rows = read_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"))
    summary = summarize(rows, evals, wall_s)
    summary["preset"] = cfg.loss.name or "custom"
    summary["seed"] = cfg.seed
    summary["torch_threads"] = torch.get_num_threads()  # results are per (machine, seed, threads)
    summary.update(hostinfo.machine())  # cpu_model, cpu_id, kernel_isa, cpu_count
    summary["torch_version"] = torch.__version__
    if cfg.log.plot and rows:
        plot_runs({summary["preset"]: rows}, os.path.join(cfg.output_dir, "plot.png"),
                  title=f"{summary['preset']} (seed {cfg.seed})", evals=evals)
    table = format_table(summary)
    # per-problem held-out records (train/evaluation.py): intervals and the paired gain
    summary["heldout"] = evaluation.summarize_heldout(evaluation.read_records(cfg.output_dir))
    table += heldout_lines(summary["heldout"])
    with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(cfg.output_dir, "summary.md"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)  # the CLI's summary table (rank 0)
    return summary
