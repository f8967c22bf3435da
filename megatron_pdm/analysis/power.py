"""The number of seeds a paired comparison needs, chosen before the study runs.

The study's paired statistic is the per-seed difference d_s = rate(predictive) - rate(ratio).
To detect a mean difference `effect` when the d_s spread with standard deviation `sd` (measured
on a pilot), with a two-sided test at level alpha and power 1 - beta:

    normal approximation   n_z = ((z_{1-alpha/2} + z_{1-beta}) * sd / effect)^2
    paired t-test          n_t = n_z + z_{1-alpha/2}^2 / 2   (Guenther 1981: the t-test's
                           correction; within one seed of the exact noncentral-t answer for
                           n >= 10, e.g. 34 for effect/sd = 0.5, the textbook value)

both rounded up. At the paper's -2.7 pp with a per-seed SD of 5.9 pp: n_z = 37.5 -> 38, n_t = 40.
`pilot_sd` reads the SD of the per-seed differences from a pilot study's results.json.

The pilot must be independent of the study: a pilot whose seeds are among the study's (an
internal pilot) lets the seeds that chose n count again in the test. `check_independent` refuses
that, naming both seed lists (the study runs other seeds, e.g. `--first-seed`). After the study,
inference.power_check sets the SD measured on the study's own seeds beside the assumed one.
"""

from __future__ import annotations

import json
import statistics

from megatron_pdm.significance import seeds_needed  # the one formula; re-exported here

__all__ = ["check_independent", "pilot_sd", "pilot_seeds", "seeds_needed"]


def pilot_sd(results_json: str, criterion: str | None = None) -> tuple[float, int]:
    """(SD of the per-seed paired differences, number of defined seeds) of a pilot study.

    Args:
        results_json: a study's results.json (either design) or its stored copy.
        criterion: the predictive criterion of the pair (default: the first pair).

    Raises:
        ValueError: no such pair, or fewer than 2 seeds with a defined difference.
    """
    with open(results_json) as f:
        results = json.load(f)
    if "summary" in results:
        summary = results["summary"]
    else:  # a stored copy (stored.py): the summary recomputed from its per-seed counts
        from megatron_pdm.analysis.stored import recompute

        summary = recompute(results)
    pairs = summary.get("paired", [])
    pick = [p for p in pairs if criterion is None or p["criterion"] == criterion]
    pick = sorted(pick, key=lambda p: not p.get("primary", False))  # the primary first
    if not pick:
        raise ValueError(f"{results_json}: no paired comparison for {criterion or 'any'} "
                         f"(pairs: {[p['criterion'] for p in pairs]})")
    diffs = [d for d in pick[0]["per_seed_difference"] if d is not None]
    if len(diffs) < 2:
        raise ValueError(f"{results_json}: {len(diffs)} seeds with a defined difference for "
                         f"{pick[0]['criterion']}; a pilot needs at least 2")
    return statistics.stdev(diffs), len(diffs)


def pilot_seeds(results_json: str) -> list:
    """The seeds a pilot study ran (its results.json `setup.seeds`).

    Raises:
        ValueError: the file records no seeds (its independence cannot be checked).
    """
    with open(results_json) as f:
        seeds = json.load(f).get("setup", {}).get("seeds")
    if not seeds:
        raise ValueError(f"{results_json}: no setup.seeds recorded; a pilot's seeds must be "
                         "known to check that the study does not reuse them")
    return list(seeds)


def check_independent(pilot: str, pilot_seed_list: list, study_seeds: list) -> None:
    """Refuses a pilot whose seeds overlap the study's.

    Raises:
        ValueError: naming the pilot file, both seed lists and the shared seeds.
    """
    shared = sorted(set(pilot_seed_list) & set(study_seeds))
    if shared:
        raise ValueError(
            f"--pilot {pilot}: its seeds {list(pilot_seed_list)} overlap the study's seeds "
            f"{list(study_seeds)} (shared: {shared}); a pilot that chooses the seed count "
            "must be independent of the study: run the study on other seeds (--seeds or "
            f"--first-seed {max(pilot_seed_list) + 1})")
