"""Decoding helpers shared by the response parsers (JSON and flat/base64 top-K).

What: `loads` (orjson with the cyclic GC paused, stdlib fallback for NaN/Infinity tokens),
C-level list -> numpy conversions that name the bad entry, rank-order sorting of top-K rows, the
`RolloutSample` constructor used by every parser, and `checked_support`, which runs the one
support contract (`megatron_pdm.ops.support`) and reports a failure as a
`RolloutValidationError` naming the sample and the token position.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from typing import Any

import numpy as np
import orjson
import torch

from megatron_pdm.ops.support import SupportError, check_support, fold_support
from rollout_bridge.core.types import RolloutSample, RolloutValidationError


class MalformedResponseError(RolloutValidationError):
    """The body is not valid JSON or not a /generate response (retryable by the client)."""


_GC_LOCK = threading.Lock()
_GC_STATE = {"depth": 0, "was_enabled": False}


@contextlib.contextmanager
def gc_paused():
    """Pauses Python's cyclic garbage collector around a large JSON decode (thread-safe).

    A K=20 x 8k-token body decodes into ~700k Python objects; every 700 allocations the collector
    runs and, in a process holding torch's large heap, a full collection scans all of it. Measured
    on a 5.5 MB body: orjson.loads 95 ms with the collector on, 44 ms paused (more inside a
    trainer process). The decoded JSON tree holds no reference cycles, so pausing creates no
    uncollectable garbage.

    The collector flag is process-global while decodes run concurrently in executor threads, so
    the pause is reference-counted: the first entrant records the flag and disables the
    collector, the last one to leave restores the recorded flag.
    """
    with _GC_LOCK:
        if _GC_STATE["depth"] == 0:
            _GC_STATE["was_enabled"] = gc.isenabled()
            gc.disable()
        _GC_STATE["depth"] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_STATE["depth"] -= 1
            if _GC_STATE["depth"] == 0 and _GC_STATE["was_enabled"]:
                gc.enable()


def loads(body: bytes | str) -> Any:
    """Decodes JSON with orjson, falling back to the stdlib for NaN/Infinity tokens.

    Raises:
        MalformedResponseError: If the body is not JSON.
    """
    try:
        with gc_paused():
            return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:  # Python's json.dumps writes NaN / -Infinity, which orjson rejects.
            return json.loads(body)
        except (ValueError, TypeError):
            raise MalformedResponseError(f"malformed JSON: {exc}") from None


def floats(items: list, count: int) -> np.ndarray:
    """[count] float64 from a list of numbers; JSON null becomes NaN (caught by validation)."""
    try:
        return np.fromiter(items, dtype=np.float64, count=count)
    except TypeError:
        return np.array(items, dtype=np.float64)


def ints(items: list, count: int, what: str, sample_index: int) -> np.ndarray:
    try:
        return np.fromiter(items, dtype=np.int64, count=count)
    except (TypeError, ValueError):
        bad = next(i for i, x in enumerate(items) if not isinstance(x, int))
        raise RolloutValidationError(f"non-integer token id {items[bad]!r} in {what}",
                                     sample_index, bad) from None


def first(mask: np.ndarray) -> int:
    """Index of the first True row of a [T] or [T, S] mask."""
    if mask.ndim > 1:
        mask = mask.any(axis=1)
    return int(np.flatnonzero(mask)[0])


def check_topk_values(lp_tk: np.ndarray, present_tk: np.ndarray, sample_index: int) -> np.ndarray:
    """Valid mask of engine top-K entries: -inf (probability 0) becomes an invalid slot; NaN or
    +inf on a present entry is an error in every transport (JSON, flat, scoring).

    Args:
        lp_tk: [T, K] logprobs. present_tk: [T, K] bool, entries the engine returned.

    Returns:
        [T, K] bool valid mask.
    """
    bad_tk = present_tk & (np.isnan(lp_tk) | np.isposinf(lp_tk))
    if bad_tk.any():
        p = first(bad_tk)
        value = lp_tk[p][bad_tk[p]][0]
        raise RolloutValidationError(f"top-K logprob {value} (NaN, +inf or null)", sample_index,
                                     p)
    return present_tk & ~np.isneginf(lp_tk)


def sort_rank_order(ids_tk: np.ndarray, lp_tk: np.ndarray, valid_tk: np.ndarray):
    """Puts each row in descending-logprob order with invalid slots last (no-op when sorted)."""
    key_tk = np.where(valid_tk, lp_tk, -np.inf)
    if valid_tk.all() and (key_tk[:, :-1] >= key_tk[:, 1:]).all():
        return ids_tk, lp_tk, valid_tk
    order_tk = np.argsort(-key_tk, axis=1, kind="stable")
    order_tk = np.where(valid_tk.any(axis=1, keepdims=True), order_tk, np.arange(ids_tk.shape[1]))
    take = lambda a: np.take_along_axis(a, order_tk, axis=1)  # noqa: E731
    return take(ids_tk), take(lp_tk), take(valid_tk)


def folded_support(top_ids: np.ndarray, top_lp: np.ndarray, top_valid: np.ndarray,
                   sampled_ids: np.ndarray, sampled_lp: np.ndarray, vocab_size: int | None,
                   sample_index: int, validate: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """`fold_support` then (optionally) `check_support`, errors as RolloutValidationError.

    Returns:
        (support_ids [T, S] int32, support_logprobs [T, S] fp32, support_valid [T, S] bool,
        number of positions whose sampled token was inside the top-K).
    """
    ids_ts, lp_ts, valid_ts, n_in = fold_support(top_ids, top_lp, top_valid, sampled_ids,
                                                 sampled_lp)
    if validate:
        try:
            check_support(ids_ts, lp_ts, valid_ts, sampled_ids, vocab_size, sampled_lp)
        except SupportError as err:
            raise RolloutValidationError(f"{err.detail}" + (
                f" (slot {err.slot})" if err.slot is not None else ""), sample_index,
                err.row) from None
    return ids_ts, lp_ts, valid_ts, n_in


def to_sample(sampled_ids, sampled_lp, ids_ts, lp_ts, valid_ts, reason: str,
              meta_info: dict) -> RolloutSample:
    """A `RolloutSample` from parsed arrays (prompt_ids empty: the caller fills them)."""
    return RolloutSample(
        prompt_ids=torch.empty(0, dtype=torch.int64),
        response_ids=torch.from_numpy(np.ascontiguousarray(sampled_ids, dtype=np.int64)),
        behavior_logprob=torch.from_numpy(sampled_lp.astype(np.float32)),
        support_ids=torch.from_numpy(ids_ts),
        support_logprobs=torch.from_numpy(lp_ts),
        support_valid=torch.from_numpy(valid_ts),
        finish_reason=reason,
        meta_info=meta_info,
    )
