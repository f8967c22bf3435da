"""Per-run outcomes (curves, end numbers, the collapse flag) and paired method comparisons.

Collapse (pre-registered, fixed before any grid run; docs/stability.md): a run collapsed when
  (a) any optimizer step logged a non-finite policy loss or gradient norm, or
  (b) its greedy held-out accuracy after RL is more than ACC_DROP below its accuracy before RL, or
  (c) its mean training reward over the last WINDOW iterations is below REWARD_FRACTION of its
      mean over the first WINDOW iterations (only when that start mean is > 0).
"""

from __future__ import annotations

import json
import math
import os
from statistics import fmean

from megatron_pdm import metrics as M
from megatron_pdm import significance as sig
from megatron_pdm.train.logging_utils import read_metrics

ACC_DROP = 0.10
REWARD_FRACTION = 0.5
WINDOW = 5

# curve name -> (metric key, how the steps of one iteration are combined)
CURVES = {
    "reward": (M.REWARD_MEAN, "last"),
    "sampled_kl_first_step": (M.SAMPLED_KL, "first"),
    "sampled_kl": (M.SAMPLED_KL, "mean"),
    "masked_frac": (M.MASKED_FRAC, "mean"),
    # tokens a correction preset drops (icepop's token mask, geo-rs's sequence rejection)
    "is_masked_frac": (M.OFFPOLICY_MASKED_FRAC, "mean"),
    "entropy": (M.ENTROPY_SAMPLED, "last"),
    "grad_norm": (M.GRAD_NORM, "mean"),
    "staleness": (M.STALENESS, "last"),
    "steps_per_batch": (M.STEPS_THIS_BATCH, "max"),
}
END_OUTCOMES = ("greedy_acc_after_rl", "reward_end", "sampled_kl_end", "masked_frac_end",
                "is_masked_frac_end", "entropy_end", "grad_norm_end")


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) else float("nan")


def _combine(values: list[float], how: str) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if how == "first":
        return values[0] if values else float("nan")
    if how == "last":
        return values[-1] if values else float("nan")
    if not finite:
        return float("nan")
    return max(finite) if how == "max" else fmean(finite)


def curves(rows: list[dict]) -> dict[str, list[float]]:
    """One value per iteration for every CURVES entry."""
    by_it: dict[int, list[dict]] = {}
    for r in rows:
        by_it.setdefault(int(r[M.ITERATION]), []).append(r)
    out: dict[str, list[float]] = {}
    for name, (key, how) in CURVES.items():
        out[name] = [_combine([_num(r.get(key)) for r in by_it[i]], how) for i in sorted(by_it)]
    return out


def _window_mean(values: list[float], tail: bool) -> float:
    part = values[-WINDOW:] if tail else values[:WINDOW]
    finite = [v for v in part if math.isfinite(v)]
    return fmean(finite) if finite else float("nan")


def collapse(rows: list[dict], c: dict[str, list[float]], acc_before: float,
             acc_after: float) -> dict:
    """The pre-registered collapse flag with the reason(s) it fired."""
    reasons = []
    if any(not math.isfinite(_num(r.get(M.GRAD_NORM))) or
           not math.isfinite(_num(r.get(M.LOSS_PG, 0.0))) for r in rows):
        reasons.append("non-finite loss or gradient norm")
    if math.isfinite(acc_before) and math.isfinite(acc_after) and acc_after < acc_before - ACC_DROP:
        reasons.append(f"greedy accuracy fell {acc_before - acc_after:.3f} > {ACC_DROP}")
    start, end = _window_mean(c["reward"], False), _window_mean(c["reward"], True)
    if start > 0 and end < REWARD_FRACTION * start:
        reasons.append(f"reward fell to {end / start:.2f} of its start")
    return {"collapsed": bool(reasons), "reasons": reasons}


def run_record(run_dir: str, cell, *, wall_s: float) -> dict:
    """The record of one finished run (what records.jsonl holds)."""
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    c = curves(rows)
    before, after = _num(s.get("greedy_acc_before_rl")), _num(s.get("greedy_acc_after_rl"))
    end = {"greedy_acc_before_rl": before, "greedy_acc_after_rl": after,
           "reward_end": _window_mean(c["reward"], True),
           "sampled_kl_end": _window_mean(c["sampled_kl_first_step"], True),
           "masked_frac_end": _window_mean(c["masked_frac"], True),
           "is_masked_frac_end": _window_mean(c["is_masked_frac"], True),
           "entropy_end": _window_mean(c["entropy"], True),
           "grad_norm_end": _window_mean(c["grad_norm"], True)}
    return {"cell": cell.name, "method": cell.method, "setting": cell.setting, "seed": cell.seed,
            "preset": s.get("preset"), "wall_s": wall_s, "end": end, "curves": c,
            # train.eval_interval's held-out curve (iteration -> accuracy; ends only without it)
            "greedy_by_iteration": s.get("greedy_acc_by_iteration", {}),
            "collapse": collapse(rows, c, before, after),
            # where the run ran (the driver's summary.json; absent in runs before it recorded them)
            "machine": {k: s[k] for k in ("cpu_model", "cpu_id", "kernel_isa", "torch_threads")
                        if k in s},
            "measured": {"staleness_max": max(c["staleness"], default=float("nan")),
                         "steps_per_batch": max(c["steps_per_batch"], default=float("nan"))}}


DEFAULT_OUTCOMES = ("greedy_acc_after_rl", "reward_end")


def index(records: list[dict]) -> dict[tuple, dict]:
    """(method, setting, seed) -> record."""
    return {(r["method"], r["setting"], r["seed"]): r for r in records}


def seed_pairs(cells: dict[tuple, dict], setting: str, method: str, baseline: str,
               outcome: str) -> list[tuple[float, float]]:
    """(method's, baseline's) end value of `outcome` for every seed both ran in `setting`, both
    finite, in seed order: what a comparison row is computed from."""
    seeds = sorted(s for (m, st, s) in cells if m == method and st == setting
                   and (baseline, setting, s) in cells)
    pairs = [(cells[(method, setting, s)]["end"][outcome],
              cells[(baseline, setting, s)]["end"][outcome]) for s in seeds]
    return [(x, y) for x, y in pairs if math.isfinite(x) and math.isfinite(y)]


def compare(records: list[dict], *, baseline: str, outcomes=DEFAULT_OUTCOMES,
            primary: str | None = None, resamples: int = 20000) -> list[dict]:
    """Every method against `baseline` in every setting, paired by seed: mean difference,
    bootstrap CI, sign-flip p, Holm-adjusted within its family.

    Families: without `primary`, every row returned is one family. With `primary` (a
    pre-registered outcome), the rows of that outcome are the primary family and the other
    rows the secondary family, each Holm-adjusted on its own; `row["family"]` says which."""
    unknown = [o for o in outcomes if o not in END_OUTCOMES]
    if unknown:
        raise ValueError(f"unknown outcome(s) {unknown}; known: {list(END_OUTCOMES)}")
    if primary is not None and primary not in outcomes:
        raise ValueError(f"primary outcome {primary!r} is not among outcomes {list(outcomes)}")
    cells = index(records)
    methods = sorted({r["method"] for r in records} - {baseline})
    settings = sorted({r["setting"] for r in records})
    rows, pvals = [], {}
    for setting in settings:
        for method in methods:
            for outcome in outcomes:
                pairs = seed_pairs(cells, setting, method, baseline, outcome)
                if not pairs:
                    continue
                diffs = [x - y for x, y in pairs]
                key = f"{setting}:{method}-{baseline}:{outcome}"
                test = sig.sign_flip_test(diffs, resamples=resamples, seed=0)
                ci = (sig.paired_bootstrap_ci([x for x, _ in pairs], [y for _, y in pairs],
                                              resamples=resamples, seed=0)
                      if len(pairs) > 1 else None)
                pvals[key] = test["p"]
                rows.append({"key": key, "setting": setting, "method": method,
                             "baseline": baseline, "outcome": outcome, "n_seeds": len(pairs),
                             "mean_diff": fmean(diffs), "ci95": ci, "p": test["p"],
                             "nonzero": test["nonzero"]})
    for r in rows:
        r["family"] = ("all" if primary is None else
                       "primary" if r["outcome"] == primary else "secondary")
    for family in {r["family"] for r in rows}:
        members = [r for r in rows if r["family"] == family]
        adjusted = sig.holm({r["key"]: pvals[r["key"]] for r in members})
        for r in members:
            r["p_holm"] = adjusted[r["key"]]
            # the smallest Holm-adjusted p these seeds can reach: all non-zero differences of
            # one sign give sign-flip p = 2^(1 - nonzero); below 0.05 only then can a row decide
            floor = min(1.0, len(members) * 2.0 ** (1 - max(r.pop("nonzero"), 1)))
            r["p_holm_floor"] = floor
            r["verdict"] = ("higher" if r["p_holm"] < 0.05 and r["mean_diff"] > 0 else
                            "lower" if r["p_holm"] < 0.05 and r["mean_diff"] < 0 else
                            "no difference" if floor < 0.05 else
                            f"undecided: {r['n_seeds']} seeds cannot reach p < 0.05")
    return rows
