"""Per-seed counts and rates of the mask study, from the before/after token tables (§3.7).

Definitions (one seed; "active" = loss token with a support and A != 0, the only tokens that
carry a gradient, §6.8; D = the criterion's proximity divergence; dD = D(after) - D(before),
both against the stored behaviour policy mu):

    out of region       active and D(before) > delta(sign A)
    kept                the criterion's mask M = 1 before the step
    unsafe keep         kept, out of region, and dD > tol after the criterion's OWN step
    unsafe keep rate    #unsafe keep / #(kept and out of region)
    shrink share        #(kept, out of region, dD < -tol) / #(kept and out of region)
    disagreement set    active tokens whose direction test differs from the ratio baseline's
                        ((away > 0) != (A (r - 1) > 0)), reported overall and out of region
    own sign accuracy   on kept active tokens: sign(away) == sign(dD) after the criterion's own
                        step (tokens with |dD| <= tol or away == 0 are left out)

Decomposition controls (when the after tables carry them, criteria.control_key): the same
tokens and the same masks, D's change after two other steps from the same state, counted like
the full step with the key suffix "@momentum" / "@gradient":

    @momentum   the zero-gradient step (the optimizer's momentum alone, one table for all
                criteria; each criterion's kept set is counted on it)
    @gradient   plain SGD on the criterion's own masked loss (no optimizer state)

so every unsafe-keep rate, shrink share, mean dD and own sign accuracy stands next to what
the momentum alone and the masked gradient alone would have given.

Prediction scores against the unmasked reference step (every token's own update applied): for
every criterion's direction, the share of active tokens whose sign(away) matches sign(dD_ref),
overall, out of region, and on each predictive criterion's disagreement set, where exactly one
of the two directions can be right (their signs differ). When the table carries state hashes,
also separately for tokens whose state (prompt + prefix) no other active token of the batch
shares and for those that share it: tokens of one state share one softmax, so the step moves
their D by the sum of their updates, and samples of a GRPO group with opposite advantages get
one realised change for opposite predictions (the per-token lemma assumes independent states).

`tol` (default 0) is a dead zone for "dD > 0": with tol > 0, changes within +-tol count as neither
shrinking nor growing. All counts are ints, rates floats or None when the denominator is 0.
"""

from __future__ import annotations

import torch

from megatron_pdm.analysis.controls import control_keep
from megatron_pdm.analysis.criteria import CONTROLS, KEEP_ALL, Criterion, control_key
from megatron_pdm.analysis.token_table import TokenTable

__all__ = ["count_seed", "rate", "shared_state"]


def rate(num: int, den: int) -> float | None:
    """num / den, None when den == 0."""
    return None if den == 0 else num / den


def _n(mask: torch.Tensor) -> int:
    return int(mask.sum())


def _sign_hits(away: torch.Tensor, delta_d: torch.Tensor, sel: torch.Tensor,
               tol: float) -> tuple[int, int]:
    """(correct, decided) of sign(away) vs sign(dD) on `sel`."""
    up, down = delta_d > tol, delta_d < -tol
    decided = sel & (up | down) & (away != 0)
    correct = decided & (((away > 0) & up) | ((away < 0) & down))
    return _n(correct), _n(decided)


def _check_aligned(before: TokenTable, after: TokenTable, name: str) -> None:
    if len(before) != len(after):
        raise ValueError(f"after-step table of {name!r} has {len(after)} tokens, the "
                         f"before table {len(before)}: the tokens must be the same")
    if not torch.equal(before["adv"], after["adv"]):
        raise ValueError(f"after-step table of {name!r}: advantages differ from the before "
                         "table (token order changed between evaluations)")


def _step_counts(kept_oor: torch.Tensor, kept_active: torch.Tensor, away: torch.Tensor,
                 delta_d: torch.Tensor, tol: float, suffix: str = "") -> dict:
    """What one step did to a criterion's kept tokens (keys end with `suffix`)."""
    n_kept_oor = _n(kept_oor)
    n_unsafe = _n(kept_oor & (delta_d > tol))
    n_shrink = _n(kept_oor & (delta_d < -tol))
    own_ok, own_n = _sign_hits(away, delta_d, kept_active, tol)
    out = {"n_unsafe_kept": n_unsafe, "n_shrink_kept": n_shrink,
           "n_flat_kept": n_kept_oor - n_unsafe - n_shrink,
           "unsafe_keep_rate": rate(n_unsafe, n_kept_oor),
           "shrink_share": rate(n_shrink, n_kept_oor),
           "mean_delta_d_kept_out_of_region": (float(delta_d[kept_oor].mean()) if n_kept_oor
                                               else None),
           "sum_delta_d_kept_out_of_region": float(delta_d[kept_oor].sum()),
           "own_sign_correct": own_ok, "own_sign_decided": own_n,
           "own_sign_accuracy": rate(own_ok, own_n)}
    return {k + suffix: v for k, v in out.items()}


def _criterion_counts(c: Criterion, before: TokenTable, after: dict[str, TokenTable],
                      baseline_away: torch.Tensor | None, tol: float,
                      kept: torch.Tensor | None = None) -> dict:
    """Criterion c's counts; `kept` (a synthetic control's decisions, controls.py) replaces
    c's own mask, everything else (its step, its direction score) stays c's."""
    active = before["adv"] != 0
    d0 = before[c.divergence]
    delta = c.cfg.delta_high  # delta_low == delta_high for every study criterion
    oor = active & (d0 > delta)
    if kept is None:
        kept = before[f"keep/{c.name}"] > 0
    away = before[f"away/{c.name}"]
    kept_oor = kept & oor
    delta_d = after[c.name][c.divergence] - d0
    out = {
        "divergence": c.divergence, "delta": delta,
        "n_out_of_region": _n(oor), "n_kept_out_of_region": _n(kept_oor),
        "n_masked_out_of_region": _n(oor & ~kept),
        **_step_counts(kept_oor, kept & active, away, delta_d, tol),
        "n_disagree": None, "n_disagree_out_of_region": None,
        "own_sign_accuracy_disagree": None,
    }
    for control in CONTROLS:  # the same tokens and masks under the control steps
        key = control_key(c.name, control)
        if key in after:
            out.update(_step_counts(kept_oor, kept & active, away,
                                    after[key][c.divergence] - d0, tol, f"@{control}"))
    if baseline_away is not None:
        dis = active & ((away > 0) != (baseline_away > 0))
        ok, n = _sign_hits(away, delta_d, dis & kept, tol)
        out.update(n_disagree=_n(dis), n_disagree_out_of_region=_n(dis & oor),
                   own_sign_accuracy_disagree=rate(ok, n))
    return out


def shared_state(before: TokenTable) -> torch.Tensor | None:
    """[n] bool: active tokens whose state (prompt + prefix) another active token shares, or
    None when the table has no state columns."""
    if "state_h1" not in before.columns:
        return None
    active = before["adv"] != 0
    key = before["state_h1"].long() * (1 << 31) + before["state_h2"].long()
    key = torch.where(active, key, -1 - torch.arange(len(key)))  # inactive rows never match
    _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
    return active & (counts[inverse] > 1)


def _prediction_scores(criteria: list[Criterion], before: TokenTable, ref: TokenTable,
                       tol: float) -> dict:
    active = before["adv"] != 0
    shared = shared_state(before)
    out = {}
    for c in criteria:
        d0 = before[c.divergence]
        delta_d = ref[c.divergence] - d0
        oor = active & (d0 > c.cfg.delta_high)
        away = before[f"away/{c.name}"]
        ok, n = _sign_hits(away, delta_d, active, tol)
        ok_o, n_o = _sign_hits(away, delta_d, oor, tol)
        entry = {"correct": ok, "decided": n, "accuracy": rate(ok, n),
                 "correct_out_of_region": ok_o, "decided_out_of_region": n_o,
                 "accuracy_out_of_region": rate(ok_o, n_o)}
        if shared is not None:
            for label, sel in (("unique_state", active & ~shared), ("shared_state", shared)):
                ok_s, n_s = _sign_hits(away, delta_d, sel, tol)
                entry.update({f"correct_{label}": ok_s, f"decided_{label}": n_s,
                              f"accuracy_{label}": rate(ok_s, n_s)})
        if c.baseline is not None:
            base_away = before[f"away/{c.baseline}"]
            dis = active & ((away > 0) != (base_away > 0))
            ok_d, n_d = _sign_hits(away, delta_d, dis, tol)
            ok_b, n_b = _sign_hits(base_away, delta_d, dis, tol)
            entry.update(disagree_correct=ok_d, disagree_decided=n_d,
                         disagree_accuracy=rate(ok_d, n_d), baseline_disagree_correct=ok_b,
                         baseline_disagree_decided=n_b,
                         baseline_disagree_accuracy=rate(ok_b, n_b))
        out[c.name] = entry
    return out


def _control_counts(ctrl, c: Criterion, before: TokenTable, after: dict[str, TokenTable],
                    tol: float, seed: int) -> dict:
    """A synthetic control's counts (controls.py): c's step, the control's keep decisions."""
    active = before["adv"] != 0
    d0 = before[c.divergence]
    oor = active & (d0 > c.cfg.delta_high)
    kept_base = before[f"keep/{c.name}"] > 0
    kept = control_keep(ctrl, kept_base, oor, after[c.name][c.divergence] - d0, tol=tol,
                        seed=seed)
    out = _criterion_counts(c, before, after, None, tol, kept=kept)
    out.update(control=ctrl.kind, base=c.name, flip=ctrl.flip,
               n_flipped_out_of_region=_n((kept != kept_base) & oor))
    return out


def count_seed(criteria: list[Criterion], before: TokenTable, after: dict[str, TokenTable], *,
               tol: float = 0.0, controls: tuple = (), control_seed: int = 0) -> dict:
    """All per-seed counts and rates (module docstring).

    Args:
        criteria: the compared criteria.
        before: the table before any step (masks, directions and D of every criterion).
        after: criterion name -> table after ITS step from the same state; KEEP_ALL -> after
            the unmasked reference step (optional: without it there are no prediction scores);
            optionally the control steps under `criteria.control_key` (module docstring).
        tol: dead zone of dD (>= 0).
        controls: synthetic controls (controls.Control), counted under their names beside
            the criteria from their base criterion's tables.
        control_seed: seeds the oracle control's flips (the study seed).

    Returns:
        {"n_tokens", "n_active", "n_shared_state" (None without state columns),
        "criteria": {name: {...}}, "prediction": {name: {...}} or {}}.
    """
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    missing = [c.name for c in criteria if c.name not in after]
    if missing:
        raise ValueError(f"no after-step table for criteria {missing}")
    for name, table in after.items():
        _check_aligned(before, table, name)
    per = {}
    for c in criteria:
        base_away = before[f"away/{c.baseline}"] if c.baseline is not None else None
        per[c.name] = _criterion_counts(c, before, after, base_away, tol)
    by_name = {c.name: c for c in criteria}
    for ctrl in controls:
        if ctrl.base not in by_name:
            raise ValueError(f"control {ctrl.name}: base criterion {ctrl.base!r} not among "
                             f"{list(by_name)}")
        per[ctrl.name] = _control_counts(ctrl, by_name[ctrl.base], before, after, tol,
                                         control_seed)
    pred = (_prediction_scores(criteria, before, after[KEEP_ALL], tol) if KEEP_ALL in after
            else {})
    shared = shared_state(before)
    return {"n_tokens": len(before), "n_active": _n(before["adv"] != 0),
            "n_shared_state": None if shared is None else _n(shared), "criteria": per,
            "prediction": pred}
