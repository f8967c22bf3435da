"""Did RL make the policy better on held-out problems? The gain of several seeds' runs, pooled.

Each run directory holds the driver's eval.jsonl (per-problem held-out results,
megatron_pdm/train/evaluation.py), metrics.jsonl and summary.json. The held-out problems are the
same for every seed (`task.eval_problems`), so the seeds pair by problem:

    d_p      = mean over seeds s of (end_{s,p} - start_{s,p})       (p = one held-out problem)
    gain     = mean over p of d_p                                   (= the mean of the seeds' gains)
    interval = percentile bootstrap of mean(d_p) over the problems (95%, descriptive)
    p-value  = sign-flip permutation test of mean(d_p) = 0 (valid with the many d_p = 0)

The interval covers problem-sampling noise for these seeds; the seed-to-seed spread is shown
beside it (each seed's own gain, paired bootstrap interval and exact McNemar p). `learning_report`
writes results.json, results.md and curves.png (training reward per iteration, held-out greedy
accuracy at both ends per seed with Wilson intervals).
"""

from __future__ import annotations

import json
import os
import statistics

from megatron_pdm import significance as sig
from megatron_pdm.train import evaluation as ev
from megatron_pdm.train.logging_utils import read_metrics

__all__ = ["load_run", "pooled_gain", "learning_report"]

SIGN_FLIP_RESAMPLES = sig.SIGN_FLIP_RESAMPLES
"""Random sign patterns of the pooled test (significance's default; `_fmt_p` names its floor)."""

TIME_KEYS = ("time/rollout_s", "time/fwd_bwd_s", "time/optimizer_s", "time/weight_sync_s",
             "time/iteration_s")


def load_run(run_dir: str) -> dict:
    """One run: its seed, per-iteration reward and times, and its evaluation records."""
    summary_path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(summary_path):
        raise FileNotFoundError(f"{run_dir}: no summary.json (the run did not finish)")
    with open(summary_path) as f:
        summary = json.load(f)
    records = ev.read_records(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir}: no {ev.EVAL_FILE} (a run of a driver without "
                                "per-problem evaluation records)")
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    last: dict[int, dict] = {}
    for r in rows:
        last[r["iteration"]] = r  # an iteration's last row carries its phase times
    first: dict[int, dict] = {}
    for r in rows:
        first.setdefault(r["iteration"], r)
    its = sorted(first)
    return {"dir": run_dir, "seed": summary.get("seed"), "preset": summary.get("preset"),
            "summary": summary, "records": records,
            "reward": [first[i]["reward/mean"] for i in its],
            "times": {k: [last[i].get(k) for i in its] for k in TIME_KEYS}}


def _per_problem(runs: list[dict], kind: str, start: str, end: str) -> list[float] | None:
    cols = []
    for run in runs:
        a, b = run["records"].get(start), run["records"].get(end)
        if a is None or b is None:
            raise ValueError(f"{run['dir']}: no {start!r} / {end!r} evaluation to pair")
        if a.problems != runs[0]["records"][start].problems or a.problems != b.problems:
            raise ValueError(f"{run['dir']}: its held-out problems differ from "
                             f"{runs[0]['dir']}'s: seeds pair by problem (same task and "
                             "train.eval_prompts)")
        va, vb = getattr(a, kind), getattr(b, kind)
        if va is None or vb is None:
            return None
        cols.append([y - x for x, y in zip(va, vb)])
    return [statistics.fmean(ds) for ds in zip(*cols)]


def pooled_gain(runs: list[dict], *, start: str = "before_rl", end: str = "after_rl",
                seed: int = 0) -> dict:
    """The seeds' gain end - start, paired by problem (module docstring), greedy and sampled."""
    if not runs:
        raise ValueError("no runs")
    out = {"seeds": [r["seed"] for r in runs], "from": start, "to": end,
           "problems": len(runs[0]["records"][start].problems)}
    for kind in ("greedy", "sampled"):
        d = _per_problem(runs, kind, start, end)
        if d is None:
            continue
        flip = sig.sign_flip_test(d, resamples=SIGN_FLIP_RESAMPLES, seed=seed)
        out[kind] = {
            "start_acc": statistics.fmean(statistics.fmean(getattr(r["records"][start], kind))
                                          for r in runs),
            "end_acc": statistics.fmean(statistics.fmean(getattr(r["records"][end], kind))
                                        for r in runs),
            "gain": statistics.fmean(d),
            "bootstrap_ci95_descriptive": sig.bootstrap_ci(d, seed=seed),
            "sign_flip_p": flip["p"],
            "sign_flip_exact": flip["exact"],
        }
    return out


def _fmt_p(k: dict) -> str:
    """The sign-flip p; a Monte-Carlo p at its floor 1 / (1 + resamples) (no random flip reached
    the observed sum) is an upper bound, and says so."""
    p = k["sign_flip_p"]
    floor = 1.0 / (1 + SIGN_FLIP_RESAMPLES)
    if not k.get("sign_flip_exact", True) and p <= floor * (1 + 1e-9):
        return f"sign-flip p < {2 * floor:.0e} (0 of {SIGN_FLIP_RESAMPLES:,} random flips)"
    return f"sign-flip p {p:.2g}"


def _fmt_ci(ci) -> str:
    return f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "[-]"


def markdown(result: dict) -> str:
    p = result["pooled"]
    lines = [f"Held-out gain {p['from']} -> {p['to']}, {p['problems']} problems, seeds "
             f"{', '.join(str(s) for s in p['seeds'])} (paired by problem; interval: bootstrap "
             "95% over problems, descriptive; p: sign-flip test).", "",
             "| seed | greedy before | greedy after | gain [95%] | gained / lost | McNemar p | "
             "sampled before | sampled after | sampled gain [95%] | trainer reproduces |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["seeds"]:
        h, g = s["heldout"], s["heldout"]["gain"]
        ea, eb = h["evaluations"][g["from"]], h["evaluations"][g["to"]]
        gr = g["greedy"]
        samp = ("-", "-", "-")
        if "sampled" in g:
            samp = (f"{ea['sampled']['acc']:.3f}", f"{eb['sampled']['acc']:.3f}",
                    f"{g['sampled']['gain']:+.3f} {_fmt_ci(g['sampled']['paired_bootstrap_ci95'])}")
        cc = [h["evaluations"][n].get("crosscheck") for n in (g["from"], g["to"])]
        repro = " / ".join(f"{c['reproduced_frac']:.3f}" if c else "-" for c in cc)
        lines.append(
            f"| {s['seed']} | {ea['greedy']['acc']:.3f} | {eb['greedy']['acc']:.3f} | "
            f"{gr['gain']:+.3f} {_fmt_ci(gr['paired_bootstrap_ci95'])} | {gr.get('gained', '-')}"
            f" / {gr.get('lost', '-')} | {gr.get('mcnemar_p', float('nan')):.2g} | "
            f"{samp[0]} | {samp[1]} | {samp[2]} | {repro} |")
    for kind in ("greedy", "sampled"):
        if kind in p:
            k = p[kind]
            lines.append(f"| **pooled {kind}** | {k['start_acc']:.3f} | {k['end_acc']:.3f} | "
                         f"**{k['gain']:+.3f} {_fmt_ci(k['bootstrap_ci95_descriptive'])}** | | "
                         f"{_fmt_p(k)} | | | | |")
    lines += ["", "Seconds per iteration (median over iterations, per seed): " + "; ".join(
        f"seed {s['seed']}: " + ", ".join(f"{k.removeprefix('time/')} {v:.1f}"
                                          for k, v in s["median_times"].items() if v is not None)
        for s in result["seeds"])]
    return "\n".join(lines) + "\n"


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def plot(runs: list[dict], result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        ax.plot(range(len(r["reward"])), r["reward"], marker="o", label=f"seed {r['seed']}")
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("training reward (mean of the batch)")
    ax.set_title("training reward")
    ax.legend()
    g = result["pooled"]
    for i, s in enumerate(result["seeds"]):
        ev_ = s["heldout"]["evaluations"]
        xs, ys, lo, hi = [], [], [], []
        for name in (g["from"], g["to"]):
            e = ev_[name]["greedy"]
            xs.append(ev_[name]["iteration"] + 0.1 * i)
            ys.append(e["acc"])
            w = e.get("wilson_ci95") or (e["acc"], e["acc"])
            lo.append(max(0.0, e["acc"] - w[0]))  # float rounding at acc 0 or 1
            hi.append(max(0.0, w[1] - e["acc"]))
        bx.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=f"seed {s['seed']}")
    bx.set_xlabel("RL iteration")
    bx.set_ylabel(f"held-out greedy accuracy ({g['problems']} problems)")
    bx.set_title("held-out greedy accuracy (Wilson 95%)")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def learning_report(run_dirs: list[str], out_dir: str, *, start: str = "before_rl",
                    end: str = "after_rl", seed: int = 0, plot_png: bool = True) -> dict:
    runs = [load_run(d) for d in run_dirs]
    seeds = [r["seed"] for r in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"runs share a seed: {seeds} ({', '.join(run_dirs)})")
    result = {
        "runs": run_dirs,
        "pooled": pooled_gain(runs, start=start, end=end, seed=seed),
        "seeds": [{"seed": r["seed"], "preset": r["preset"], "dir": r["dir"],
                   "heldout": ev.summarize_heldout(r["records"], start=start, end=end, seed=seed),
                   "reward": r["reward"],
                   "median_times": {k: _median(v) for k, v in r["times"].items()},
                   "wall_s": r["summary"].get("wall_s")} for r in runs],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(result))
    if plot_png:
        plot(runs, result, os.path.join(out_dir, "curves.png"))
    return result
