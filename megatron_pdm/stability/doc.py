"""docs/stability.md's generated blocks: every number in them is read from a results.json that
`megatron-pdm-stability` wrote (megatron_pdm/analysis/doc_blocks.py is the block mechanism;
megatron_pdm/tools/study_report.py registers these kinds beside the analysis ones).

    stability-pivot        results/stability/<run>/results.json   greedy accuracy after RL per
                                                                  setting x method (masked
                                                                  fraction, collapses)
    stability-methods      the same                               one row per method (a run
                                                                  of one setting)
    stability-comparisons  the same                               the primary outcome's paired
                                                                  comparisons (or all rows)
    stability-words        the same                               report.in_words
"""

from __future__ import annotations

import json
from statistics import stdev

from megatron_pdm.stability import summary as S
from megatron_pdm.stability.report import fmt, in_words, masked_total


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _f(v, digits: int = 3) -> str:
    return fmt(v, digits, missing="n/a")


def _methods(result: dict) -> list[str]:
    """The grid's method order (its --methods), restricted to methods with cells."""
    have = {c["method"] for c in result["cells"]}
    return [m for m in result["grid"]["methods"] if m in have]


def _settings(result: dict) -> list[str]:
    have = {c["setting"] for c in result["cells"]}
    return [s for s in result["grid"]["settings"] if s in have]


def _cell(result: dict, setting: str, method: str) -> dict | None:
    return next((c for c in result["cells"]
                 if c["setting"] == setting and c["method"] == method), None)


def _header(result: dict) -> str:
    seeds = sorted({s for c in result["cells"] for s in c["seeds"]})
    m = result["machine"]
    return (f"{len(result['runs'])} runs, seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}), "
            f"{m['cpu']}{', ' + m['cpu_id'] if m.get('cpu_id') else ''}, "
            f"OMP_NUM_THREADS={m['threads']}")


def pivot(path: str, label: str = "") -> str:
    """Greedy held-out accuracy after RL, seed mean, per setting (rows) x method (columns):
    `after (masked fraction at the end) cN` with N the collapsed seeds."""
    r = _load(path)
    methods, out = _methods(r), []
    out.append(f"Greedy held-out accuracy after RL, seed mean (fraction of tokens masked at the "
               f"end, by the trust region or by a correction's rejection; cN: N seeds collapsed)."
               f" {_header(r)}; from `{label or path}`.\n")
    out.append("| setting | before | " + " | ".join(methods) + " |")
    out.append("|---|---|" + "---|" * len(methods))
    for s in _settings(r):
        cells = [_cell(r, s, m) for m in methods]
        before = next((c["greedy_acc_before_rl"] for c in cells if c), float("nan"))
        row = [f"{_f(c['greedy_acc_after_rl'])} ({_f(masked_total(c))})"
               + (f" c{c['collapsed']}" if c["collapsed"] else "") if c else "-"
               for c in cells]
        out.append(f"| {s} | {_f(before)} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


def methods_table(path: str, label: str = "") -> str:
    """One row per method (and setting): accuracy before -> after, collapses, masked fraction,
    sampled KL and reward at the end."""
    r, out = _load(path), []
    out.append(f"{_header(r)}; from `{label or path}`.\n")
    out.append("| setting | method | greedy acc before -> after RL | collapsed | masked frac "
               "(end) | sampled KL (end) | reward (end) |")
    out.append("|---|---|---|---|---|---|---|")
    for s in _settings(r):
        for m in _methods(r):
            c = _cell(r, s, m)
            if c is None:
                continue
            out.append(f"| {s} | {m} | {_f(c['greedy_acc_before_rl'])} -> "
                       f"{_f(c['greedy_acc_after_rl'])} | {c['collapsed']}/{len(c['seeds'])} | "
                       f"{_f(masked_total(c))} | {_f(c['sampled_kl_end'], 5)} | "
                       f"{_f(c['reward_end'])} |")
    return "\n".join(out) + "\n"


def comparisons(path: str, label: str = "") -> str:
    """The comparison rows of the primary outcome (all rows when none was pre-registered), with
    wins / losses / ties and the SD of the paired differences recomputed from the records."""
    r = _load(path)
    rows = [c for c in r["comparisons"] if r.get("primary") in (None, c["outcome"])]
    out = [f"Paired by seed against {r['baseline']}; from `{label or path}`.\n",
           "| setting | comparison | outcome | mean diff | 95% CI (bootstrap) | wins / losses / "
           "ties | SD of differences | p | Holm p | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    cells = S.index(r["runs"])
    for c in rows:  # the per-seed differences behind the row, by the rule compare() used
        d = [x - y for x, y in S.seed_pairs(cells, c["setting"], c["method"], c["baseline"],
                                            c["outcome"])]
        wins, losses = sum(x > 0 for x in d), sum(x < 0 for x in d)
        ci = "n/a" if c["ci95"] is None else f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]"
        out.append(f"| {c['setting']} | {c['method']} - {c['baseline']} | {c['outcome']} | "
                   f"{c['mean_diff']:+.3f} | {ci} | {wins} / {losses} / {len(d) - wins - losses}"
                   f" | {_f(stdev(d) if len(d) > 1 else float('nan'))} | {_f(c['p'], 4)} | "
                   f"{_f(c['p_holm'], 4)} | {c['verdict']} |")
    return "\n".join(out) + "\n"


def words(path: str, label: str = "") -> str:
    return "\n".join(in_words(_load(path))[2:]) + "\n"  # without the heading


KINDS = {"stability-pivot": pivot, "stability-methods": methods_table,
         "stability-comparisons": comparisons, "stability-words": words}

__all__ = ["KINDS", "comparisons", "methods_table", "pivot", "words"]
