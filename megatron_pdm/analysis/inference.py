"""The mask study's inference across seeds: pooled counts, paired tests fit for tie-heavy data,
Holm over every comparison of one results file, the pre-registered primary comparison, and the
per-seed SD this study measured beside the one its power analysis assumed.

Pooled view (per criterion and rate): k events of n eligible tokens summed over seeds (for the
unsafe-keep rate: kept out-of-region tokens whose D grew / kept out-of-region tokens) with a
Wilson 95% interval, and `n_seeds_no_rate`, the seeds where the criterion had no eligible token
(denominator 0). The Wilson interval treats tokens as independent; tokens of one seed share one
step, so read it as a description of the pooled count, not as a test.

Paired comparison (criterion vs baseline on one rate): per seed d_s = rate(criterion) -
rate(baseline) on the seeds where both rates are defined. Every seed run is accounted for:
`n_seeds_run` = `n_seeds_entered` + the seeds without a rate (`n_seeds_no_rate`: for the
criterion, the baseline, and either). Tests on the d_s (megatron_pdm/significance.py):

    sign_flip_p   the decision test: two-sided sign-flip permutation test of mean(d) = 0 (exact
                  up to 20 non-zero d_s, else 20,000 seeded random patterns); exact zeros weigh
                  nothing, so seeds that tie need no rule of their own
    sign_test_p   exact two-sided sign test of wins vs losses (reported beside)
    p_holm        Holm's adjustment of sign_flip_p over EVERY comparison in the summary (the
                  predictive-vs-ratio pairs and the synthetic controls together; also
                  sign_test_p_holm for the sign test)
    p_floor       the smallest sign_flip_p these seeds could give (all non-zero d_s of one
                  sign: 2^(1 - nonzero)); above alpha the comparison is "undecided" whatever
                  the data, and says so
    bootstrap_ci95_descriptive   percentile bootstrap interval of mean(d): a description only;
                  with 70-90% exact zeros it is too narrow to base a claim on

Verdicts: "lower" / "higher" (criterion vs baseline, p_holm < alpha), "not detected"
(p_holm >= alpha where p_floor < alpha), "undecided: ..." otherwise. The primary comparison
(`primary`, "CRITERION:BASELINE[:RATE]", named before the run; default pdm-agg vs ratio on the
unsafe-keep rate) is marked `primary: true`; it is adjusted with the rest (no comparison is
exempt from Holm).

`power_check`: for the primary comparison, the SD of its d_s measured on this study's own seeds
beside the SD the power analysis assumed, and the power each gives for the stated effect at the
seeds that entered.
"""

from __future__ import annotations

import statistics

from megatron_pdm import significance

__all__ = ["ALPHA", "DEFAULT_PRIMARY", "adjust", "compare", "parse_primary", "pooled_rate",
           "power_check"]

ALPHA = 0.05
DEFAULT_PRIMARY = "pdm-agg:ratio:unsafe_keep_rate"
RESAMPLES = 20000


def parse_primary(spec: str, names: list[str] | None = None,
                  rates: tuple[str, ...] = ("unsafe_keep_rate",)) -> tuple[str, str, str]:
    """(criterion, baseline, rate) of "CRITERION:BASELINE[:RATE]".

    Raises:
        ValueError: a malformed spec, a name not among `names`, or an unknown rate.
    """
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"primary comparison {spec!r}: write CRITERION:BASELINE[:RATE], "
                         f"e.g. {DEFAULT_PRIMARY!r}")
    crit, base = parts[0], parts[1]
    rate = parts[2] if len(parts) == 3 else "unsafe_keep_rate"
    if rate not in rates:
        raise ValueError(f"primary comparison {spec!r}: rate {rate!r} is not one of {rates}")
    if names is not None:
        missing = [n for n in (crit, base) if n not in names]
        if missing:
            raise ValueError(f"primary comparison {spec!r}: {missing} not among the study's "
                             f"criteria {names}; name the primary comparison (--primary) "
                             "among them before the run")
    if crit == base:
        raise ValueError(f"primary comparison {spec!r}: a criterion against itself")
    return crit, base, rate


def pooled_rate(nums: list[int | None], dens: list[int | None]) -> dict:
    """k / n pooled over seeds with its Wilson 95% interval, and the seeds without a rate."""
    k = sum(x for x, d in zip(nums, dens) if d)
    n = sum(d for d in dens if d)
    return {"k": k, "n": n, "rate": k / n if n else None,
            "wilson95": significance.wilson_interval(k, n) if n else None,
            "n_seeds_no_rate": sum(1 for d in dens if not d)}


def compare(a: list[float | None], b: list[float | None], *, criterion: str, baseline: str,
            rate: str, seed: int = 0) -> dict:
    """One paired comparison of per-seed rates `a` (criterion) and `b` (baseline), same seeds
    in the same order (None: no rate on that seed). Not yet Holm-adjusted (`adjust`)."""
    if len(a) != len(b):
        raise ValueError(f"compare {criterion} vs {baseline}: {len(a)} and {len(b)} seeds; the "
                         "per-seed rates must cover the same seeds")
    per_seed = [x - y if x is not None and y is not None else None for x, y in zip(a, b)]
    diffs = [d for d in per_seed if d is not None]
    sign = significance.sign_test(diffs)
    flip = significance.sign_flip_test(diffs, resamples=RESAMPLES, seed=seed)
    return {
        "criterion": criterion, "baseline": baseline, "metric": rate,
        "n_seeds_run": len(a), "n_seeds_entered": len(diffs), "seeds": len(diffs),
        "n_seeds_no_rate": {"criterion": sum(1 for x in a if x is None),
                            "baseline": sum(1 for y in b if y is None),
                            "either": len(a) - len(diffs)},
        "wins": sign["negative"], "losses": sign["positive"], "ties": sign["ties"],
        "nonzero": flip["nonzero"],
        "mean_difference": statistics.fmean(diffs) if diffs else None,
        "sd_difference": statistics.stdev(diffs) if len(diffs) > 1 else None,
        "sign_flip_p": flip["p"] if diffs else None, "sign_flip_exact": flip["exact"],
        "sign_test_p": sign["p"] if sign["positive"] + sign["negative"] else None,
        "p_floor": min(1.0, 2.0 ** (1 - flip["nonzero"])) if flip["nonzero"] else 1.0,
        "bootstrap_ci95_descriptive": significance.bootstrap_ci(diffs, seed=seed),
        "per_seed_difference": per_seed,
    }


def adjust(rows: list[dict], primary: tuple[str, str, str] | None, *,
           alpha: float = ALPHA) -> list[dict]:
    """Holm over every row (sign-flip and sign-test p separately), the primary marked, and each
    row's verdict. Rows without a defined p (no seed entered) enter the family with p = 1."""
    keys = [f"{r['criterion']}:{r['baseline']}:{r['metric']}" for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"comparisons: duplicates in {keys}")
    holm = significance.holm({k: 1.0 if r["sign_flip_p"] is None else r["sign_flip_p"]
                              for k, r in zip(keys, rows)}) if rows else {}
    holm_s = significance.holm({k: 1.0 if r["sign_test_p"] is None else r["sign_test_p"]
                                for k, r in zip(keys, rows)}) if rows else {}
    for k, r in zip(keys, rows):
        r["key"] = k
        r["family_size"] = len(rows)
        r["p_holm"] = holm[k]
        r["sign_test_p_holm"] = holm_s[k]
        r["primary"] = primary is not None and (r["criterion"], r["baseline"],
                                                r["metric"]) == tuple(primary)
        if r["p_holm"] < alpha and r["mean_difference"] < 0:
            r["verdict"] = "lower"
        elif r["p_holm"] < alpha and r["mean_difference"] > 0:
            r["verdict"] = "higher"
        elif r["p_floor"] < alpha:
            r["verdict"] = "not detected"
        else:
            r["verdict"] = (f"undecided: {r['nonzero']} non-zero differences in "
                            f"{r['n_seeds_entered']} seeds cannot reach p < {alpha:g}")
    if primary is not None and not any(r["primary"] for r in rows):
        raise ValueError(f"primary comparison {':'.join(primary)} is not among the "
                         f"comparisons {keys}")
    return rows


def power_check(power: dict | None, row: dict | None) -> dict | None:
    """The SD the power analysis assumed beside the one measured on this study's seeds, and the
    power each gives for the stated effect at the seeds that entered `row` (the primary)."""
    if not power or row is None:
        return None
    n, effect = row["n_seeds_entered"], power["effect"]
    sd_m = row["sd_difference"]

    def pw(sd):
        return significance.power_paired(effect, sd, n) if sd and sd > 0 and n >= 2 else None

    out = {"comparison": row["key"], "effect": effect, "sd_assumed": power["sd"],
           "sd_source": power.get("sd_source", "stated"), "sd_measured": sd_m,
           "n_seeds_entered": n, "n_seeds_run": row["n_seeds_run"],
           "power_at_assumed_sd": pw(power["sd"]), "power_at_measured_sd": pw(sd_m),
           "seeds_asked": power.get("t_test")}
    if sd_m and sd_m > 0:
        out["seeds_needed_at_measured_sd"] = significance.seeds_needed(effect, sd_m)["t_test"]
    else:
        out["seeds_needed_at_measured_sd"] = None
    return out
