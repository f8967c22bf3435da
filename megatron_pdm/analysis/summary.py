"""Across seeds: pooled and per-seed-mean rates, and the paired comparisons (inference.py).

Input: the list of per-seed `count_seed` dicts. For every criterion (and synthetic control,
controls.py):

    pooled rate       sum of numerators / sum of denominators over seeds (every kept
                      out-of-region token weighs the same) with its Wilson 95% interval (k, n,
                      wilson95) and `n_seeds_no_rate`, the seeds whose denominator is 0
    mean rate         mean of the per-seed rates (every seed weighs the same; seeds without a
                      rate are left out of the mean and counted in `n_seeds_no_rate`), with a
                      percentile bootstrap interval labelled descriptive
    per-seed means    of the out-of-region, kept out-of-region, disagreement counts

With the decomposition controls (counting.py), the same rates under the zero-gradient step
("<rate>@momentum") and the plain-SGD own-gradient step ("<rate>@gradient"), and the pooled mean
realised dD of kept out-of-region tokens under each ("mean_delta_d_kept_out_of_region[@...]").

Paired comparisons (`summary["paired"]`, inference.compare / adjust): every predictive criterion
against its ratio baseline, every synthetic control against its base, and the pre-registered
primary comparison, all on the unsafe-keep rate (a lower rate wins); sign-flip and sign tests on
the per-seed differences, Holm over all of them, the primary marked. `power_check` sets the SD
measured on the primary's seeds beside the power analysis' assumed one; `controls_check` says
whether the positive control was detected and the negative one was not.

Resampling uses seeded `random.Random` generators (significance.py), so every interval and
Monte-Carlo p-value is reproducible bit for bit.
"""

from __future__ import annotations

from megatron_pdm import significance
from megatron_pdm.analysis import controls as controls_mod
from megatron_pdm.analysis import inference

__all__ = ["sign_test_p", "summarize"]

_RATES = {  # rate name -> (numerator key, denominator key) in count_seed's criteria entries
    "unsafe_keep_rate": ("n_unsafe_kept", "n_kept_out_of_region"),
    "shrink_share": ("n_shrink_kept", "n_kept_out_of_region"),
    "own_sign_accuracy": ("own_sign_correct", "own_sign_decided"),
}
_CONTROL_RATES = {  # the same rates under the decomposition controls (counting.py)
    f"{name}@{control}": (f"{num}@{control}", den if den == "n_kept_out_of_region"
                          else f"{den}@{control}")
    for control in ("momentum", "gradient") for name, (num, den) in _RATES.items()}
_PRED = {  # prediction score name -> (numerator, denominator) in count_seed's prediction entries
    "accuracy": ("correct", "decided"),
    "accuracy_out_of_region": ("correct_out_of_region", "decided_out_of_region"),
    "disagree_accuracy": ("disagree_correct", "disagree_decided"),
    "baseline_disagree_accuracy": ("baseline_disagree_correct", "baseline_disagree_decided"),
    "accuracy_unique_state": ("correct_unique_state", "decided_unique_state"),
    "accuracy_shared_state": ("correct_shared_state", "decided_shared_state"),
}
_COUNTS = ("n_out_of_region", "n_kept_out_of_region", "n_masked_out_of_region", "n_unsafe_kept",
           "n_disagree", "n_disagree_out_of_region")


def sign_test_p(wins: int, losses: int) -> float | None:
    """Two-sided exact binomial p-value of wins vs losses under p = 1/2 (None if both 0)."""
    if wins + losses == 0:
        return None
    return significance.sign_test([1.0] * wins + [-1.0] * losses)["p"]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _pooled(entries: list[dict], num: str, den: str) -> float | None:
    n = sum(e[num] for e in entries if e.get(num) is not None)
    d = sum(e[den] for e in entries if e.get(den) is not None)
    return n / d if d else None


def _per_seed(entries: list[dict], num: str, den: str) -> list[float | None]:
    return [e[num] / e[den] if e.get(den) and e.get(num) is not None else None
            for e in entries]


def _rate_summary(entries: list[dict], num: str, den: str, seed: int) -> dict:
    per_seed = _per_seed(entries, num, den)
    defined = [x for x in per_seed if x is not None]
    pooled = inference.pooled_rate([e.get(num) for e in entries], [e.get(den) for e in entries])
    return {"pooled": _pooled(entries, num, den), "k": pooled["k"], "n": pooled["n"],
            "wilson95": pooled["wilson95"], "n_seeds_no_rate": pooled["n_seeds_no_rate"],
            "mean": _mean(defined), "seeds": len(defined),
            "bootstrap_ci95_descriptive": significance.bootstrap_ci(defined, seed=seed),
            "per_seed": per_seed}


def _criterion_summary(name: str, seeds: list[dict], seed: int) -> dict:
    entries = [s["criteria"][name] for s in seeds]
    out = {"divergence": entries[0]["divergence"], "delta": entries[0]["delta"]}
    controls = {k: v for k, v in _CONTROL_RATES.items() if v[0] in entries[0]}
    for rate_name, (num, den) in {**_RATES, **controls}.items():
        out[rate_name] = _rate_summary(entries, num, den, seed)
    for suffix in ("", "@momentum", "@gradient"):  # mean realised dD of kept out-of-region
        key = f"sum_delta_d_kept_out_of_region{suffix}"
        if key in entries[0]:
            kept = sum(e["n_kept_out_of_region"] for e in entries)
            out[f"mean_delta_d_kept_out_of_region{suffix}"] = (
                sum(e[key] for e in entries) / kept if kept else None)
    for key in _COUNTS:
        values = [e[key] for e in entries if e.get(key) is not None]
        out[f"mean_{key}"] = _mean(values)
        out[f"total_{key}"] = sum(values) if values else None
    preds = [s["prediction"][name] for s in seeds if name in s.get("prediction", {})]
    if preds:
        out["prediction"] = {k: _rate_summary(preds, num, den, seed)
                             for k, (num, den) in _PRED.items() if num in preds[0]}
    return out


def summarize(seeds: list[dict], criteria: list, *, controls: list | tuple = (),
              primary: str | None = None, power: dict | None = None,
              bootstrap_seed: int = 0) -> dict:
    """The across-seed summary (module docstring).

    Args:
        seeds: per-seed `count_seed` outputs, in seed order.
        criteria: the `Criterion`s (names and ratio baselines).
        controls: the synthetic controls counted in `seeds` (controls.Control).
        primary: the pre-registered primary comparison "CRITERION:BASELINE[:RATE]" (None:
            none marked).
        power: the power analysis that chose the seeds (power.seeds_needed + sd_source), for
            `power_check`.
        bootstrap_seed: seed of the bootstrap's and the permutation test's generators.

    Returns:
        {"seeds": n, "shared_state_fraction": active tokens sharing their state / active tokens
        (None without state columns), "criteria": {name: {...}}, "paired": [{...} per
        comparison], "primary", "power_check", "controls_check"}.
    """
    if not seeds:
        raise ValueError("summarize: no seeds")
    names = [c.name for c in criteria] + [c.name for c in controls]
    per = {n: _criterion_summary(n, seeds, bootstrap_seed) for n in names}
    pairs = [(c.name, c.baseline, "unsafe_keep_rate") for c in criteria if c.baseline is not None]
    pairs += [(c.name, c.base, "unsafe_keep_rate") for c in controls]
    prim = inference.parse_primary(primary, names) if primary else None
    if prim is not None and prim not in pairs:
        pairs.insert(0, prim)
    rows = [inference.compare(per[a][rate]["per_seed"], per[b][rate]["per_seed"], criterion=a,
                              baseline=b, rate=rate, seed=bootstrap_seed)
            for a, b, rate in pairs]
    rows = inference.adjust(rows, prim)
    shared = [s.get("n_shared_state") for s in seeds]
    n_active = sum(s.get("n_active", 0) for s in seeds)
    frac = (sum(shared) / n_active if n_active and None not in shared else None)
    out = {"seeds": len(seeds), "shared_state_fraction": frac, "criteria": per, "paired": rows,
           "primary": ":".join(prim) if prim else None}
    out["power_check"] = inference.power_check(
        power, next((r for r in rows if r["primary"]), None))
    out["controls_check"] = controls_mod.check(out, list(controls))
    return out
