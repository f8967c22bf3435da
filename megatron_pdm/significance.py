"""Significance tests and intervals shared by the mask study, the stability benchmark and the
held-out evaluations. Standard library only (no torch), deterministic for a given seed.

Paired designs (the same seeds, prompts or problems under two methods) give per-unit differences
d_i = x_i - y_i. The tests here are exact or resampling tests that stay valid when many d_i are
exactly 0 and the rest are large (tie-heavy data, where a percentile bootstrap of the mean is
anti-conservative):

    sign_test(d)          exact two-sided binomial test of #(d > 0) vs #(d < 0), ties dropped
    sign_flip_test(d)     permutation test of mean(d) = 0: every sign pattern (exact for
                          n <= 20 non-zero d_i, else `resamples` random patterns); zeros keep
                          their place and weigh nothing, so ties need no special rule
    mcnemar_exact(a, b)   paired binary outcomes (the same held-out problems solved or not under
                          two methods): the exact sign test on the discordant pairs
    holm(p)               Holm's step-down adjustment over a family of comparisons

Intervals: `bootstrap_ci` (percentile; descriptive, label it so), `paired_bootstrap_ci` (of
mean(a - b), the units resampled together), `wilson_interval` (a binomial proportion).
`power_paired` is the normal-approximation power of a two-sided paired test with a t correction.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from statistics import NormalDist, fmean

__all__ = ["bootstrap_ci", "holm", "mcnemar_exact", "paired_bootstrap_ci", "power_paired",
           "seeds_needed", "sign_flip_test", "sign_test", "wilson_interval"]

EXACT_FLIP_LIMIT = 20
"""sign_flip_test enumerates all 2^n sign patterns up to this many non-zero differences."""
SIGN_FLIP_RESAMPLES = 20000
"""Random sign patterns of `sign_flip_test` above the exact limit (its p has floor 1 / (1 + this))."""


def _finite(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    for i, v in enumerate(out):
        if not math.isfinite(v):
            raise ValueError(f"{what}: value {i} is {v}; every value must be finite")
    return out


def _binom_two_sided(k: int, n: int) -> float:
    """Two-sided exact binomial p-value of k successes in n at p = 1/2 (doubling the smaller
    tail, capped at 1)."""
    if n == 0:
        return 1.0
    tail = min(k, n - k)
    p = sum(math.comb(n, i) for i in range(tail + 1)) / 2.0 ** n
    return min(1.0, 2.0 * p)


def sign_test(diffs: Sequence[float]) -> dict:
    """Exact two-sided sign test of paired differences.

    Returns: {"n", "positive", "negative", "ties", "p"}; p = 1 when every difference is 0.
    """
    d = _finite(diffs, "sign_test")
    pos = sum(1 for v in d if v > 0)
    neg = sum(1 for v in d if v < 0)
    return {"n": len(d), "positive": pos, "negative": neg, "ties": len(d) - pos - neg,
            "p": _binom_two_sided(pos, pos + neg)}


def sign_flip_test(diffs: Sequence[float], *, resamples: int = SIGN_FLIP_RESAMPLES,
                   seed: int = 0) -> dict:
    """Two-sided paired permutation test of mean(diffs) = 0 by sign flips.

    Under the null each difference is as likely positive as negative. The p-value is the share
    of sign patterns whose |sum| is at least the observed |sum| (with a 1e-12 relative tolerance
    for float ties). Exact enumeration for <= EXACT_FLIP_LIMIT non-zero differences, else
    `resamples` random patterns with the observed one counted (p = (1 + hits) / (1 + resamples)).

    Returns: {"n", "nonzero", "mean", "p", "exact"}.
    """
    d = _finite(diffs, "sign_flip_test")
    nz = [abs(v) for v in d if v != 0]
    observed = abs(sum(d))
    tol = 1e-12 * max(1.0, sum(nz))
    out = {"n": len(d), "nonzero": len(nz), "mean": fmean(d) if d else float("nan")}
    if not nz:
        return {**out, "p": 1.0, "exact": True}
    if len(nz) <= EXACT_FLIP_LIMIT:
        hits = 0
        for signs in itertools.product((1.0, -1.0), repeat=len(nz)):
            if abs(sum(s * v for s, v in zip(signs, nz))) >= observed - tol:
                hits += 1
        return {**out, "p": hits / 2 ** len(nz), "exact": True}
    if resamples < 1:
        raise ValueError(f"sign_flip_test: resamples={resamples} must be >= 1")
    rng = random.Random(seed)
    hits = 0
    for _ in range(resamples):
        if abs(sum(v if rng.random() < 0.5 else -v for v in nz)) >= observed - tol:
            hits += 1
    return {**out, "p": (1 + hits) / (1 + resamples), "exact": False}


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> dict:
    """Exact McNemar test of paired binary outcomes (unit i solved under a / under b).

    Returns: {"n", "a_only", "b_only", "both", "neither", "difference" (acc_a - acc_b), "p"}.

    Raises:
        ValueError: the two lists differ in length or are empty.
    """
    if len(a_correct) != len(b_correct):
        raise ValueError(f"mcnemar_exact: {len(a_correct)} outcomes under a, {len(b_correct)} "
                         "under b; the pairs must be the same units")
    if not a_correct:
        raise ValueError("mcnemar_exact: no paired outcomes")
    a_only = sum(1 for x, y in zip(a_correct, b_correct) if x and not y)
    b_only = sum(1 for x, y in zip(a_correct, b_correct) if y and not x)
    both = sum(1 for x, y in zip(a_correct, b_correct) if x and y)
    n = len(a_correct)
    return {"n": n, "a_only": a_only, "b_only": b_only, "both": both,
            "neither": n - a_only - b_only - both, "difference": (a_only - b_only) / n,
            "p": _binom_two_sided(a_only, a_only + b_only)}


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm step-down adjusted p-values (family-wise error control) of named comparisons."""
    for name, p in pvalues.items():
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"holm: p-value of {name!r} is {p}, not in [0, 1]")
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m = len(order)
    adjusted: dict[str, float] = {}
    running = 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[name]))
        adjusted[name] = running
    return {name: adjusted[name] for name in pvalues}


def bootstrap_ci(values: Sequence[float], *, statistic: Callable[[list[float]], float] = fmean,
                 level: float = 0.95, resamples: int = 10000, seed: int = 0
                 ) -> tuple[float, float] | None:
    """Percentile bootstrap interval of `statistic(values)` (None for fewer than 2 values).
    Descriptive: with tie-heavy data it is too narrow; base claims on the tests above."""
    v = _finite(values, "bootstrap_ci")
    if len(v) < 2:
        return None
    if not 0 < level < 1:
        raise ValueError(f"bootstrap_ci: level={level} must be in (0, 1)")
    rng = random.Random(seed)
    stats = sorted(statistic(rng.choices(v, k=len(v))) for _ in range(resamples))
    lo = stats[int(math.floor((1 - level) / 2 * (resamples - 1)))]
    hi = stats[int(math.ceil((1 + level) / 2 * (resamples - 1)))]
    return lo, hi


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], **kwargs
                        ) -> tuple[float, float] | None:
    """Percentile bootstrap interval of mean(a - b), the units resampled together."""
    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap_ci: {len(a)} values under a, {len(b)} under b")
    return bootstrap_ci([x - y for x, y in zip(a, b)], **kwargs)


def wilson_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval: k={k}, n={n} must satisfy 0 <= k <= n, n > 0")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def power_paired(effect: float, sd: float, n: int, *, alpha: float = 0.05) -> float:
    """Power of a two-sided paired test of mean difference `effect` with per-unit SD `sd` and
    n units: Phi(|effect| sqrt(n) / sd - z_{1-alpha/2}) with n reduced by z^2/2 (the t-test
    correction that analysis/power.seeds_needed uses)."""
    if not sd > 0 or n < 2:
        raise ValueError(f"power_paired: sd={sd} must be > 0 and n={n} >= 2")
    z_a = NormalDist().inv_cdf(1 - alpha / 2)
    n_eff = max(n - z_a ** 2 / 2, 1e-9)
    return NormalDist().cdf(abs(effect) * math.sqrt(n_eff) / sd - z_a)


def seeds_needed(effect: float, sd: float, *, alpha: float = 0.05, power: float = 0.8) -> dict:
    """Seeds for a two-sided paired test of mean difference `effect`: the normal-approximation
    n, plus z^2/2 for the t-test (the same correction power_paired uses).

    Args:
        effect: the difference to detect (any unit, e.g. -0.027 for -2.7 pp; the sign is
            ignored).
        sd: the per-seed standard deviation of the paired differences (same unit).

    Returns:
        {"normal": n_z, "t_test": n_t, "effect", "sd", "alpha", "power"}; n_t is the one to use.

    Raises:
        ValueError: effect == 0, sd <= 0, alpha or power outside (0, 1).
    """
    if effect == 0 or not math.isfinite(effect):
        raise ValueError(f"power analysis: effect={effect} must be a finite non-zero difference")
    if not sd > 0:
        raise ValueError(f"power analysis: sd={sd} must be > 0 (the pilot's per-seed spread)")
    for name, v in (("alpha", alpha), ("power", power)):
        if not 0 < v < 1:
            raise ValueError(f"power analysis: {name}={v} must be in (0, 1)")
    z_a = NormalDist().inv_cdf(1 - alpha / 2)
    z_b = NormalDist().inv_cdf(power)
    n_z = ((z_a + z_b) * sd / abs(effect)) ** 2
    return {"normal": math.ceil(n_z - 1e-9), "t_test": math.ceil(n_z + z_a ** 2 / 2 - 1e-9),
            "n_normal_exact": n_z, "effect": effect, "sd": sd, "alpha": alpha, "power": power}
