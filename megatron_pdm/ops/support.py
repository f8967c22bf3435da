"""The behaviour support: its layout, how the sampled token is folded in, and its validation.

This module is the contract between rollout engines and the op (docs/math.md §3.9). Every
producer of supports (the SGLang and vLLM parsers, `LocalEngine`) folds with `fold_support` and
checks with `check_support`, once, when a sample enters the system; `token_stats(validate=True)`
runs the same `check_support` for callers that build the tensors themselves. One implementation,
one tolerance.

Layout, width S = K + 1 per response token:
  * slots 0..K-1 hold the engine's top-K in rank order (descending logprob);
  * if the sampled token is among them, its slot holds the independently returned sampled-token
    logprob (the top-list copy may be rounded differently); otherwise the sampled token sits in
    slot K;
  * unused slots (sampled token inside the top-K, short or ragged lists, -inf entries) have
    valid=False, id 0 and logprob -inf. An invalid slot is never id 0 / logprob 0 (= prob. 1).

Rules `check_support` enforces (row = token position; errors name row and slot):
  * ids are arrays of an integer dtype, valid masks bool, logprobs float (nothing is cast);
  * valid ids in [0, vocab_size); no id twice among the valid slots of a row;
  * valid logprobs finite and <= `LOGPROB_SLACK` (a log-probability above 0 is corrupt);
  * sum of the row's valid probabilities <= 1 + `SUM_MU_TOLERANCE` (larger excesses mean a
    temperature or top-p mismatch between the engine and its reported logprobs, §6.6);
  * on every row with any valid slot, the sampled id is a valid entry (it was folded in);
  * when given, the sampled ids lie in [0, vocab_size) and the sampled logprobs are finite.

`fold_support` narrows ids to int32 only after checking the exact values fit (an id 2**32 + 279
would otherwise wrap to 279 and pass every later check).

Host-side numpy (the bridge's hot path is numpy, and validation of torch inputs copies the small
replicated [N, S] arrays to the host once).

Shape legend: T rows (tokens), K top-K entries, S = K + 1 support slots.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LOGPROB_SLACK", "SUM_MU_TOLERANCE", "SupportError", "check_support", "fold_support"]

SUM_MU_TOLERANCE = 1e-4
"""A row whose valid behaviour probabilities sum to more than 1 + this is refused. fp32 engines
stay below ~1e-6; bf16 logprobs can reach ~1e-5 (docs/math.md §6.6)."""

LOGPROB_SLACK = 1e-6
"""Largest accepted log-probability (fp32 rounding of log 1 can be a hair above 0)."""


class SupportError(ValueError):
    """A support entry breaks the contract. Attributes `row` and `slot` locate it (slot None
    for row-level problems); the message names them too."""

    def __init__(self, message: str, row: int | None = None, slot: int | None = None,
                 what: str = "support"):
        where = []
        if row is not None:
            where.append(f"row {row}")
        if slot is not None:
            where.append(f"slot {slot}")
        super().__init__(f"{what}: {', '.join(where)}: {message}" if where else
                         f"{what}: {message}")
        self.row, self.slot, self.detail, self.what = row, slot, message, what


_INT32 = np.iinfo(np.int32)


def _check_dtypes(what_dtype: tuple[tuple[str, np.ndarray, str], ...]) -> None:
    """Ids must be integer arrays and masks bool arrays: a float id (13.7) or a bool id is never
    cast (the cast would truncate or turn True into id 1)."""
    for what, arr, kinds in what_dtype:
        if np.asarray(arr).dtype.kind not in kinds:
            expected = "bool" if kinds == "b" else "an integer dtype"
            raise SupportError(f"dtype {np.asarray(arr).dtype} is not {expected}", what=what)


def _check_fits_int32(ids: np.ndarray, valid: np.ndarray | None, what: str) -> None:
    """The int32 narrowing guard: an id outside int32 would wrap (2**32 + 279 -> 279)."""
    if ids.dtype.itemsize <= 4 and ids.dtype.kind == "i":
        return
    bad = (ids < _INT32.min) | (ids > _INT32.max)
    if valid is not None:
        bad &= valid
    if bad.any():
        if bad.ndim > 1:
            row, slot = _first_cell(bad)
            value = ids[row, slot]
        else:
            row, slot = _first_row(bad), None
            value = ids[row]
        raise SupportError(f"id {int(value)} out of range: does not fit int32 (the support's "
                           "dtype)", row, slot, what=what)


def fold_support(top_ids: np.ndarray, top_lp: np.ndarray, top_valid: np.ndarray,
                 sampled_ids: np.ndarray, sampled_lp: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Folds the sampled token into the top-K support (layout in the module docstring).

    Args:
        top_ids: [T, K] int top-K ids in rank order (any value on invalid slots).
        top_lp: [T, K] float top-K logprobs.
        top_valid: [T, K] bool.
        sampled_ids: [T] int sampled ids.
        sampled_lp: [T] float sampled-token logprobs (independently returned).

    Returns:
        (support_ids [T, K+1] int32, support_logprobs [T, K+1] fp32, support_valid [T, K+1] bool,
        number of positions whose sampled token was inside the top-K).

    Raises:
        SupportError: an id array that is not of an integer dtype, or a valid top-K id or a
            sampled id outside int32 (checked on the exact values, before narrowing).
    """
    _check_dtypes((("support_ids", top_ids, "iu"), ("sampled_ids", sampled_ids, "iu"),
                   ("support_valid", top_valid, "b")))
    _check_fits_int32(top_ids, top_valid, "support_ids")
    _check_fits_int32(sampled_ids, None, "sampled_ids")
    t, k = top_ids.shape
    ids_ts = np.empty((t, k + 1), dtype=np.int32)
    lp_ts = np.empty((t, k + 1), dtype=np.float32)
    valid_ts = np.empty((t, k + 1), dtype=bool)
    all_valid = bool(top_valid.all())
    # a logprob beyond fp32 becomes +-inf here (no warning): check_support refuses it
    with np.errstate(over="ignore", invalid="ignore"):
        if all_valid:
            ids_ts[:, :k] = top_ids
            lp_ts[:, :k] = top_lp
            valid_ts[:, :k] = True
        else:
            np.copyto(ids_ts[:, :k], np.where(top_valid, top_ids, 0), casting="unsafe")
            np.copyto(lp_ts[:, :k], np.where(top_valid, top_lp, -np.inf), casting="unsafe")
            valid_ts[:, :k] = top_valid
        match_tk = top_ids == sampled_ids[:, None]
        if not all_valid:
            match_tk &= top_valid
        rows, cols = np.nonzero(match_tk)
        lp_ts[rows, cols] = sampled_lp[rows]
        outside_t = ~match_tk.any(axis=1)
        ids_ts[:, k] = np.where(outside_t, sampled_ids, 0)
        lp_ts[:, k] = np.where(outside_t, sampled_lp, -np.inf)
        valid_ts[:, k] = outside_t
    return ids_ts, lp_ts, valid_ts, int(t - outside_t.sum())


def _first_row(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask.any(axis=1) if mask.ndim > 1 else mask)[0])


def _first_cell(mask_ts: np.ndarray) -> tuple[int, int]:
    row = _first_row(mask_ts)
    return row, int(np.flatnonzero(mask_ts[row])[0])


def check_support(ids_ts: np.ndarray, lp_ts: np.ndarray, valid_ts: np.ndarray,
                  sampled_ids: np.ndarray, vocab_size: int | None,
                  sampled_lp: np.ndarray | None = None) -> None:
    """Checks a folded support against the contract; raises `SupportError` at the first problem.

    Args:
        ids_ts: [T, S] int support ids; lp_ts: [T, S] float logprobs; valid_ts: [T, S] bool.
        sampled_ids: [T] int sampled ids.
        vocab_size: engine vocabulary; None skips the upper range checks.
        sampled_lp: [T] sampled-token logprobs, checked when given.
    """
    _check_dtypes((("support_ids", ids_ts, "iu"), ("sampled_ids", sampled_ids, "iu"),
                   ("support_valid", valid_ts, "b"), ("support_logprobs", lp_ts, "f"))
                  + (() if sampled_lp is None else (("sampled_logprobs", sampled_lp, "f"),)))
    t = ids_ts.shape[0]
    if t == 0:
        return
    ids = ids_ts.astype(np.int64, copy=False)
    sampled = sampled_ids.astype(np.int64, copy=False)
    bad_t = (sampled < 0) if vocab_size is None else ((sampled < 0) | (sampled >= vocab_size))
    if bad_t.any():
        row = _first_row(bad_t)
        raise SupportError(f"id {int(sampled[row])} out of range [0, {vocab_size})", row,
                           what="sampled_ids")
    if sampled_lp is not None:
        bad_t = ~np.isfinite(sampled_lp)
        if bad_t.any():
            row = _first_row(bad_t)
            raise SupportError(f"sampled-token logprob {float(sampled_lp[row])} is not finite",
                               row, what="sampled_logprobs")
        bad_t = sampled_lp > LOGPROB_SLACK
        if bad_t.any():
            row = _first_row(bad_t)
            raise SupportError(f"sampled-token logprob {float(sampled_lp[row])} > 0", row,
                               what="sampled_logprobs")
    bad_ts = valid_ts & ((ids < 0) if vocab_size is None else ((ids < 0) | (ids >= vocab_size)))
    if bad_ts.any():
        row, slot = _first_cell(bad_ts)
        raise SupportError(f"id {int(ids[row, slot])} out of range [0, {vocab_size})", row, slot,
                           what="support_ids")
    bad_ts = valid_ts & ~np.isfinite(lp_ts)
    if bad_ts.any():
        row, slot = _first_cell(bad_ts)
        raise SupportError(f"non-finite valid logprob {float(lp_ts[row, slot])}", row, slot,
                           what="support_logprobs")
    bad_ts = valid_ts & (lp_ts > LOGPROB_SLACK)
    if bad_ts.any():
        row, slot = _first_cell(bad_ts)
        raise SupportError(f"valid logprob {float(lp_ts[row, slot])} > 0", row, slot,
                           what="support_logprobs")
    s = ids.shape[1]
    if s > 1:
        # Invalid slots get distinct negative sentinels so they never collide.
        keyed = np.where(valid_ts, ids, -1 - np.arange(s, dtype=np.int64))
        order = np.argsort(keyed, axis=1, kind="stable")
        keyed = np.take_along_axis(keyed, order, axis=1)
        dup = keyed[:, 1:] == keyed[:, :-1]
        if dup.any():
            row, pos = _first_cell(dup)
            slots = sorted((int(order[row, pos]), int(order[row, pos + 1])))
            raise SupportError(f"duplicate valid id {int(keyed[row, pos])} in slots {slots[0]} "
                               f"and {slots[1]}", row, what="support_ids")
    mass_t = np.where(valid_ts, np.exp(lp_ts.astype(np.float64)), 0.0).sum(axis=1)
    bad_t = mass_t > 1.0 + SUM_MU_TOLERANCE
    if bad_t.any():
        row = _first_row(bad_t)
        raise SupportError(f"sum of behavior probabilities {float(mass_t[row]):.6f} > 1 + "
                           f"{SUM_MU_TOLERANCE} (temperature or top-p mismatch?)", row,
                           what="support_logprobs")
    has_k = (valid_ts & (ids == sampled[:, None])).any(axis=1)
    bad_t = valid_ts.any(axis=1) & ~has_k
    if bad_t.any():
        row = _first_row(bad_t)
        raise SupportError(f"sampled id {int(sampled[row])} is not a valid support entry (fold "
                           "the sampled token into the support)", row, what="support_ids")
