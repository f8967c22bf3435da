"""Across seeds: pooled and per-seed-mean rates, paired win counts, bootstrap intervals.

Input: the list of per-seed `count_seed` dicts. For every criterion:

    pooled rate       sum of numerators / sum of denominators over seeds (every kept
                      out-of-region token weighs the same)
    mean rate         mean of the per-seed rates (every seed weighs the same; seeds whose
                      denominator is 0 are left out), with a percentile bootstrap interval
    per-seed means    of the out-of-region, kept out-of-region, disagreement counts

With the decomposition controls (counting.py), the same rates under the zero-gradient step
("<rate>@momentum") and the plain-SGD own-gradient step ("<rate>@gradient"), and the pooled mean
realised dD of kept out-of-region tokens under each ("mean_delta_d_kept_out_of_region[@...]").

For every predictive criterion against its ratio baseline (the paired comparison):

    per-seed difference d_s = rate(criterion) - rate(baseline), on seeds where both are defined
    wins / losses / ties  d_s < 0 / > 0 / == 0 (a lower unsafe-keep rate wins)
    mean difference with a paired percentile bootstrap interval (seeds resampled with
    replacement; the same resampled seeds for both criteria)
    sign-test p-value     two-sided exact binomial test of wins vs losses (ties dropped)

The bootstrap uses its own seeded generator, so the intervals are reproducible bit for bit.
"""

from __future__ import annotations

import math

import torch

from megatron_pdm import significance

__all__ = ["bootstrap_mean_ci", "sign_test_p", "summarize"]

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


def bootstrap_mean_ci(values: list[float], *, samples: int = 10000, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of `values` (None for fewer than 2 values)."""
    if len(values) < 2:
        return None
    x = torch.tensor(values, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(values), (samples, len(values)), generator=g)
    means = x[idx].mean(1).sort().values
    lo = means[math.floor((1 - level) / 2 * (samples - 1))]
    hi = means[math.ceil((1 + level) / 2 * (samples - 1))]
    return float(lo), float(hi)


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


def _rate_summary(per_seed: list[float | None], pooled: float | None, seed: int) -> dict:
    defined = [x for x in per_seed if x is not None]
    return {"pooled": pooled, "mean": _mean(defined), "seeds": len(defined),
            "ci95": bootstrap_mean_ci(defined, seed=seed), "per_seed": per_seed}


def _criterion_summary(name: str, seeds: list[dict], seed: int) -> dict:
    entries = [s["criteria"][name] for s in seeds]
    out = {"divergence": entries[0]["divergence"], "delta": entries[0]["delta"]}
    controls = {k: v for k, v in _CONTROL_RATES.items() if v[0] in entries[0]}
    for rate_name, (num, den) in {**_RATES, **controls}.items():
        out[rate_name] = _rate_summary(_per_seed(entries, num, den),
                                       _pooled(entries, num, den), seed)
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
        out["prediction"] = {k: _rate_summary(_per_seed(preds, num, den),
                                              _pooled(preds, num, den), seed)
                             for k, (num, den) in _PRED.items() if num in preds[0]}
    return out


def _paired(name: str, baseline: str, per: dict, seed: int) -> dict:
    a = per[name]["unsafe_keep_rate"]["per_seed"]
    b = per[baseline]["unsafe_keep_rate"]["per_seed"]
    diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    wins = sum(1 for d in diffs if d < 0)
    losses = sum(1 for d in diffs if d > 0)
    return {"criterion": name, "baseline": baseline, "metric": "unsafe_keep_rate",
            "seeds": len(diffs), "wins": wins, "losses": losses,
            "ties": len(diffs) - wins - losses, "mean_difference": _mean(diffs),
            "ci95": bootstrap_mean_ci(diffs, seed=seed), "sign_test_p": sign_test_p(wins, losses),
            "per_seed_difference": [x - y if x is not None and y is not None else None
                                    for x, y in zip(a, b)]}


def summarize(seeds: list[dict], criteria: list, *, bootstrap_seed: int = 0) -> dict:
    """The across-seed summary (module docstring).

    Args:
        seeds: per-seed `count_seed` outputs, in seed order.
        criteria: the `Criterion`s (names and ratio baselines).
        bootstrap_seed: seed of the bootstrap's generator.

    Returns:
        {"seeds": n, "shared_state_fraction": active tokens sharing their state / active tokens
        (None without state columns), "criteria": {name: {...}},
        "paired": [{...} per predictive criterion]}.
    """
    if not seeds:
        raise ValueError("summarize: no seeds")
    per = {c.name: _criterion_summary(c.name, seeds, bootstrap_seed) for c in criteria}
    shared = [s.get("n_shared_state") for s in seeds]
    n_active = sum(s.get("n_active", 0) for s in seeds)
    paired = [_paired(c.name, c.baseline, per, bootstrap_seed) for c in criteria
              if c.baseline is not None]
    frac = (sum(shared) / n_active if n_active and None not in shared else None)
    return {"seeds": len(seeds), "shared_state_fraction": frac, "criteria": per,
            "paired": paired}
