"""Decoding helpers shared by the response parsers (JSON and flat/base64 top-K).

What: `loads` (orjson with the cyclic GC paused, stdlib fallback for NaN/Infinity tokens),
C-level list -> numpy conversions that name the bad entry, rank-order sorting of top-K rows, the
`RolloutSample` constructor used by every parser, and `folded_support`, which runs the one
support contract (`megatron_pdm.ops.support`) and reports a failure as a
`RolloutValidationError` naming the sample and the token position.
"""

from __future__ import annotations

import contextlib
import gc
import json
import operator
import reprlib
import threading
from collections.abc import Callable, Iterable
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
        MalformedResponseError: If the body is not JSON (also: nested deeper than either decoder
            allows, or an integer literal too long for the stdlib).
    """
    try:
        with gc_paused():
            return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:  # Python's json.dumps writes NaN / -Infinity, which orjson rejects.
            return json.loads(body)
        except (ValueError, TypeError, RecursionError):
            raise MalformedResponseError(f"malformed JSON: {exc}") from None


_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother, _PREVIEW.maxlong = 3, 60, 60, 40


def preview(value: Any) -> str:
    """A short repr of any decoded JSON value (depth- and length-limited: no recursion, no
    4000-digit integers in messages)."""
    return _PREVIEW.repr(value)


def text(value: Any) -> str:
    """`str(value)` for a scalar, a short preview for a container (finish reasons, errors)."""
    if value is None or isinstance(value, (str, int, float)):
        return str(value) if not isinstance(value, int) or abs(value) < 10**30 else preview(value)
    return preview(value)


def row_locator(lens_t: np.ndarray) -> Callable[[int], tuple[int, int]]:
    """Flat entry j of ragged rows with lengths lens_t -> (position, slot); used on errors only
    (the `locate` argument of `floats` / `ints` / `pair_columns`)."""
    ends_t = np.cumsum(lens_t)

    def locate(j: int) -> tuple[int, int]:
        p = int(np.searchsorted(ends_t, j, side="right"))
        return p, int(j - (ends_t[p] - lens_t[p]))
    return locate


def _where(locate: Callable[[int], tuple[int | None, int | None]] | None, j: int
           ) -> tuple[int | None, str]:
    """(position, " slot s" text) of flat entry j (default: entry j is position j)."""
    if locate is None:
        return j, ""
    position, slot = locate(j)
    return position, "" if slot is None else f" slot {slot}"


_NUMBER_TYPES = frozenset({float, int})
_NULLABLE_NUMBER_TYPES = frozenset({float, int, type(None)})
_INT64_MAX = 2**63


def floats(items: list, count: int, what: str = "logprob", sample_index: int | None = None,
           locate: Callable[[int], tuple[int | None, int | None]] | None = None) -> np.ndarray:
    """[count] float64 from a list of JSON numbers; null becomes NaN (caught by validation).

    Anything else (bool, string, list, object) is an error naming `what` and the entry: a string
    "-2.6" or a `true` is never coerced to a number.

    Raises:
        RolloutValidationError: naming sample, position (via `locate`) and field.
    """
    _check_count(items, count, what, sample_index)
    # all floats (the engines' case): one C-level count, no set built
    if operator.countOf(map(type, items), float) == count:
        try:
            return np.fromiter(items, dtype=np.float64, count=count)
        except (OverflowError, ValueError):
            pass
    types = set(map(type, items))
    if types <= _NUMBER_TYPES:
        try:
            return np.fromiter(items, dtype=np.float64, count=count)
        except (OverflowError, ValueError):
            pass
    elif types <= _NULLABLE_NUMBER_TYPES:
        try:
            return np.array(items, dtype=np.float64)
        except (OverflowError, ValueError):
            pass
    for j, x in enumerate(items):
        kind = type(x)
        if kind not in _NULLABLE_NUMBER_TYPES or (kind is int and not _fits_float(x)):
            position, slot = _where(locate, j)
            why = "is not a finite number" if kind is int else \
                f"is {_type_name(x)}, not a number"
            raise RolloutValidationError(f"{what}{slot}: logprob {preview(x)} {why}",
                                         sample_index, position)
    raise RolloutValidationError(f"{what}: entries are not numbers", sample_index)


def _check_count(items: list, count: int, what: str, sample_index: int | None) -> None:
    if len(items) != count:
        raise RolloutValidationError(f"{what}: has {len(items)} entries, expected {count}",
                                     sample_index)


def ints(items: list, count: int, what: str, sample_index: int | None,
         locate: Callable[[int], tuple[int | None, int | None]] | None = None) -> np.ndarray:
    """[count] int64 from a list of JSON integers (token ids).

    Only exact integers are ids: a float (13.7 or 13.0), a string ("13"), a bool or null is an
    error, and so is an integer outside int64 (range checks against the vocabulary, and the int32
    narrowing guard, run later on the exact values: `megatron_pdm.ops.support`).

    Raises:
        RolloutValidationError: naming sample, position (via `locate`) and field.
    """
    _check_count(items, count, what, sample_index)
    if operator.countOf(map(type, items), int) == count:  # exact ints only (a bool is not)
        try:
            return np.fromiter(items, dtype=np.int64, count=count)
        except (OverflowError, ValueError):
            pass
    for j, x in enumerate(items):
        if type(x) is not int or not -_INT64_MAX <= x < _INT64_MAX:
            position, slot = _where(locate, j)
            why = "out of range (does not fit int64)" if type(x) is int else \
                f"is {_type_name(x)}, not an integer token id"
            raise RolloutValidationError(f"{what}{slot}: id {preview(x)} {why}", sample_index,
                                         position)
    raise RolloutValidationError(f"{what}: entries are not integers", sample_index)


def _fits_float(x: int) -> bool:
    try:
        float(x)
    except OverflowError:
        return False
    return True


def _type_name(x: Any) -> str:
    return {bool: "a bool", str: "a string", list: "a list", dict: "an object",
            type(None): "null", float: "a float"}.get(type(x), type(x).__name__)


def checked_list(value: Any, what: str, sample_index: int | None,
                 position: int | None = None) -> list:
    """`value` if it is a JSON array, else an error naming the field."""
    if type(value) is not list:
        raise RolloutValidationError(f"{what} is {_type_name(value)}, not a list", sample_index,
                                     position)
    return value


def pair_columns(entries: list, count: int, what: str, sample_index: int | None,
                 locate: Callable[[int], tuple[int | None, int | None]] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(ids [count] int64, logprobs [count] float64) of `[logprob, id, ...]` entries (SGLang's
    triples; 2 or more items each).

    `entries` is the flat list of entries (a nested top-K is flattened once by the caller,
    `list(chain.from_iterable(rows))`: a list of references, the entries themselves are not
    copied). Two C-level passes over it pick item 0 and item 1 of every entry
    (`map(itemgetter(i), ...)`; an entry shorter than 2, a number, null or an object raises
    there and ends the fast path), then `ints` / `floats` check every value's type on the two
    flat columns (one C-level count each) and fill numpy. Of the JSON types only a list can put
    numbers in the columns (a string's characters are strings, refused there; an object's keys
    are strings, so item 0 raises); when a value is refused, the entries are walked once more so
    that an entry that is not a list is named as such, as the per-entry path does. (A Python
    caller's pre-decoded dict keyed by the integers 0 and 1 would read as an entry: the input is
    decoded JSON.)

    Raises:
        RolloutValidationError: naming sample, position (via `locate`) and field.
    """
    try:
        lp_list = list(map(_ITEM0, entries))
        id_list = list(map(_ITEM1, entries))
    except (TypeError, IndexError, KeyError):  # a short entry, a number, null or an object
        _check_entries(entries, what, sample_index, locate)
        raise RolloutValidationError(f"{what}: entries are not [logprob, id, ...] lists",
                                     sample_index) from None
    try:
        return (ints(id_list, count, what, sample_index, locate),
                floats(lp_list, count, what, sample_index, locate))
    except RolloutValidationError:
        _check_entries(entries, what, sample_index, locate)
        raise


_ITEM0, _ITEM1 = operator.itemgetter(0), operator.itemgetter(1)


def _check_entries(entries: Iterable, what: str, sample_index: int | None,
                   locate: Callable[[int], tuple[int | None, int | None]] | None) -> None:
    """Raises for the first entry that is not a list of 2 or more items (errors only)."""
    for j, entry in enumerate(entries):
        if type(entry) is not list or len(entry) < 2:
            position, slot = _where(locate, j)
            raise RolloutValidationError(
                f"{what}{slot}: entry {preview(entry)} is not a [logprob, id, ...] list",
                sample_index, position)


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
        j = int(np.flatnonzero(bad_tk[p])[0])
        raise RolloutValidationError(f"top-K entry {j}: logprob {lp_tk[p, j]} (NaN, +inf or "
                                     "null)", sample_index, p)
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
    try:  # the int32 narrowing guard of fold_support runs even with validate=False
        ids_ts, lp_ts, valid_ts, n_in = fold_support(top_ids, top_lp, top_valid, sampled_ids,
                                                     sampled_lp)
        if validate:
            check_support(ids_ts, lp_ts, valid_ts, sampled_ids, vocab_size, sampled_lp)
    except SupportError as err:
        slot = "" if err.slot is None else f" slot {err.slot}"
        raise RolloutValidationError(f"{err.what}{slot}: {err.detail}", sample_index,
                                     err.row) from None
    return ids_ts, lp_ts, valid_ts, n_in


def to_sample(sampled_ids, sampled_lp, ids_ts, lp_ts, valid_ts, reason: str,
              meta_info: dict) -> RolloutSample:
    """A `RolloutSample` from parsed arrays (prompt_ids empty: the caller fills them)."""
    with np.errstate(over="ignore"):  # (a validated logprob fits fp32; unvalidated: +-inf)
        behavior_lp = sampled_lp.astype(np.float32)
    return RolloutSample(
        prompt_ids=torch.empty(0, dtype=torch.int64),
        response_ids=torch.from_numpy(np.ascontiguousarray(sampled_ids, dtype=np.int64)),
        behavior_logprob=torch.from_numpy(behavior_lp),
        support_ids=torch.from_numpy(ids_ts),
        support_logprobs=torch.from_numpy(lp_ts),
        support_valid=torch.from_numpy(valid_ts),
        finish_reason=reason,
        meta_info=meta_info,
    )
