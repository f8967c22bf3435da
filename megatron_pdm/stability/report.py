"""results.json, results.md and the curve plots of a grid's records."""

from __future__ import annotations

import json
import math
import os
from statistics import fmean, stdev

from megatron_pdm.hostinfo import cpu_id, cpu_model, kernel_isa
from megatron_pdm.stability import summary as S

SCHEMA = 1


def fmt(v, digits: int = 3, missing: str = "nan") -> str:
    """`v` with `digits` decimals; `missing` for None or a non-finite value."""
    return missing if v is None or not math.isfinite(v) else f"{v:.{digits}f}"


def cell_table(records: list[dict]) -> list[dict]:
    """One row per (setting, method): seed means and spreads of the end outcomes."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["method"]), []).append(r)
    rows = []
    for (setting, method), rs in sorted(groups.items()):
        row = {"setting": setting, "method": method, "seeds": sorted(r["seed"] for r in rs),
               "collapsed": sum(r["collapse"]["collapsed"] for r in rs),
               "measured_staleness_max": max(r["measured"]["staleness_max"] for r in rs),
               "measured_steps_per_batch": max(r["measured"]["steps_per_batch"] for r in rs)}
        for name in ("greedy_acc_before_rl", *S.END_OUTCOMES):
            # .get: records written before an outcome existed (rebuild them: --rerecord)
            vals = [r["end"].get(name, float("nan")) for r in rs
                    if math.isfinite(r["end"].get(name, float("nan")))]
            row[name] = fmean(vals) if vals else float("nan")
            row[name + "_sd"] = stdev(vals) if len(vals) > 1 else float("nan")
        rows.append(row)
    return rows


def write(out: str, records: list[dict], *, command: str, grid: dict, baseline: str,
          outcomes=S.DEFAULT_OUTCOMES, primary: str | None = None, resamples: int = 20000,
          plots: bool = True) -> dict:
    comparisons = S.compare(records, baseline=baseline, outcomes=outcomes, primary=primary,
                            resamples=resamples)
    result = {"schema": SCHEMA, "command": command, "grid": grid, "baseline": baseline,
              "outcomes": list(outcomes), "primary": primary,
              "machine": {"cpu": cpu_model(), "cpu_id": cpu_id(), "kernel_isa": kernel_isa(),
                          "threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count()},
              "collapse_rule": {"acc_drop": S.ACC_DROP, "reward_fraction": S.REWARD_FRACTION,
                                "window": S.WINDOW},
              "cells": cell_table(records), "comparisons": comparisons, "runs": records}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1, sort_keys=True, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(result))
    if plots:
        plot(records, os.path.join(out, "curves.png"))
    return result


def markdown(result: dict) -> str:
    lines = [f"# Stability grid results\n", f"Command: `{result['command']}`  ",
             f"Machine (of this report): {result['machine']['cpu']}"
             f"{', ' + result['machine']['cpu_id'] if result['machine'].get('cpu_id') else ''}, "
             f"OMP_NUM_THREADS={result['machine']['threads']}, {result['machine']['cpus']} CPUs"
             f"{machines(result['runs'])}  ",
             f"Collapse rule: {result['collapse_rule']}\n",
             "| setting | method | seeds | greedy acc before -> after RL (sd) | reward end | "
             "sampled KL end | masked frac end | IS-masked frac end | entropy end | grad norm end "
             "| collapsed | staleness max | steps/batch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        lines.append(
            f"| {c['setting']} | {c['method']} | {len(c['seeds'])} | "
            f"{fmt(c['greedy_acc_before_rl'])} -> {fmt(c['greedy_acc_after_rl'])} "
            f"({fmt(c['greedy_acc_after_rl_sd'])}) | {fmt(c['reward_end'])} | "
            f"{fmt(c['sampled_kl_end'], 5)} | {fmt(c['masked_frac_end'], 4)} | "
            f"{fmt(c.get('is_masked_frac_end', float('nan')), 4)} | "
            f"{fmt(c['entropy_end'])} | {fmt(c['grad_norm_end'])} | "
            f"{c['collapsed']}/{len(c['seeds'])} | {fmt(c['measured_staleness_max'], 0)} | "
            f"{fmt(c['measured_steps_per_batch'], 0)} |")
    primary = result.get("primary")
    holm = (f"Holm within each family (primary: the `{primary}` rows, pre-registered; "
            "secondary: the other rows)" if primary else "Holm over all rows")
    lines += ["", "Paired by seed against the baseline; CI: paired bootstrap 95% (descriptive); "
              f"p: two-sided sign-flip (paired permutation) test; {holm}.\n",
              "| setting | method - baseline | outcome | family | n | mean diff | 95% CI | p | "
              "p Holm | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["comparisons"]:
        ci = ("n/a" if r["ci95"] is None else
              f"[{fmt(r['ci95'][0])}, {fmt(r['ci95'][1])}]")
        lines.append(f"| {r['setting']} | {r['method']} - {r['baseline']} | {r['outcome']} | "
                     f"{r.get('family', 'all')} | {r['n_seeds']} | {fmt(r['mean_diff'])} | {ci} | {fmt(r['p'])} | "
                     f"{fmt(r['p_holm'])} | {r['verdict']} |")
    lines += ["", *in_words(result)]
    return "\n".join(lines) + "\n"


def machines(runs: list[dict]) -> str:
    """'; runs on: <cpu, id, ISA> (n)' from the records that carry where they ran."""
    seen: dict[str, int] = {}
    for r in runs:
        m = r.get("machine") or {}
        if m:
            key = ", ".join(str(m[k]) for k in ("cpu_model", "cpu_id", "kernel_isa") if k in m)
            seen[key] = seen.get(key, 0) + 1
    return ("; runs on: " + "; ".join(f"{k} ({n})" for k, n in seen.items())) if seen else ""


def in_words(result: dict) -> list[str]:
    """The tables above in plain language, per setting: which methods the comparisons found
    higher / lower than the baseline, no different, or could not decide, per outcome; where the
    trust region bound (masked fraction at the end >= BINDS) and which runs collapsed. Written
    from the same result, so it says nothing the tables do not."""
    out = ["## In words (generated from the tables above)", ""]
    have = list(dict.fromkeys(c["setting"] for c in result["cells"]))
    order = result.get("grid", {}).get("settings") or have  # the grid's order where it says one
    settings = [s for s in order if s in have] + [s for s in have if s not in order]
    for setting in settings:
        cells = [c for c in result["cells"] if c["setting"] == setting]
        parts = []
        for outcome in result["outcomes"]:
            rows = [r for r in result["comparisons"]
                    if r["setting"] == setting and r["outcome"] == outcome]
            if not rows:
                continue
            groups: dict[str, list[str]] = {}
            for r in rows:
                groups.setdefault(r["verdict"], []).append(r["method"])
            said = "; ".join(f"{label}: {', '.join(sorted(m))}"
                             for label, m in sorted(groups.items()))
            parts.append(f"{outcome} vs {rows[0]['baseline']}: {said}")
        binds = sorted(c["method"] for c in cells if masked_total(c) >= BINDS)
        collapsed = sorted(f"{c['method']} {c['collapsed']}/{len(c['seeds'])}" for c in cells
                           if c["collapsed"])
        parts.append("masked fraction at the end (trust region or correction) >= "
                     f"{BINDS:g}: {', '.join(binds) if binds else 'no method'}")
        parts.append(f"collapsed: {', '.join(collapsed) if collapsed else 'no run'}")
        out.append(f"- **{setting}**: " + ". ".join(parts) + ".")
    return out


BINDS = 0.01  # "the trust region bound": at least 1% of tokens masked at the end of the run


def masked_total(cell: dict) -> float:
    """Tokens masked at the end by the trust region plus those a correction preset dropped
    (icepop, geo-rs); a preset uses one or the other. Cells from before the correction's
    fraction was recorded count the trust region's alone."""
    extra = cell.get("is_masked_frac_end", float("nan"))
    base = cell["masked_frac_end"]
    return (base if math.isfinite(base) else 0.0) + (extra if math.isfinite(extra) else 0.0)


GREEDY = "greedy held-out accuracy"


def plot(records: list[dict], path: str) -> None:
    """Seed-mean curves: one row of panels per setting (reward, sampled KL, entropy, grad norm,
    and the held-out greedy accuracy when a record has it between the ends:
    train.eval_interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in records})
    panels = ["reward", "sampled_kl_first_step", "entropy", "grad_norm"]
    if any(len(r.get("greedy_by_iteration", {})) > 2 for r in records):
        panels.append(GREEDY)
    fig, axes = plt.subplots(len(settings), len(panels), squeeze=False,
                             figsize=(4 * len(panels), 2.6 * len(settings)))
    for i, setting in enumerate(settings):
        methods = sorted({r["method"] for r in records if r["setting"] == setting})
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            for method in methods:
                mine = [r for r in records if r["setting"] == setting and r["method"] == method]
                if panel == GREEDY:  # seed mean at the iterations every seed evaluated
                    its = sorted(set.intersection(*(set(r.get("greedy_by_iteration", {}))
                                                    for r in mine)), key=int)
                    ax.plot([int(i) for i in its],
                            [fmean(r["greedy_by_iteration"][i] for r in mine) for i in its],
                            marker=".", label=method)
                    continue
                cs = [r["curves"][panel] for r in mine]
                n = min(len(c) for c in cs)
                ax.plot([fmean(c[t] for c in cs) for t in range(n)], label=method)
            ax.set_title(f"{setting}: {panel}", fontsize=8)
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
