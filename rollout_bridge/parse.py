"""Fast, validated parsing of SGLang `/generate` responses into rollout samples.

What: `parse_generate_response` turns the bytes of one `/generate` response (nested
`[logprob, id, null]` triples, ecosystem.md §(c)) into `RolloutSample`s with the K+1 support
layout of algorithms.md §3.9; `parse_scoring_response` does the same from SGLang's flat base64
prompt-side top-K (the opt-in binary path); `fold_support` / `validate_support` are shared with
the in-process engine.

Why this shape: at K=20 and 8k tokens a response is ~6 MB of JSON and decoding it dominates the
rollout->trainer path. The JSON path makes exactly one `orjson.loads` and then flattens the nested
lists with C-level iterators (`itertools.chain`, list slicing, `np.fromiter`), so no Python code
runs per triple; all folding and validation is vectorized numpy. The binary path decodes base64
straight into numpy (`np.frombuffer`, no copy).

Validation (every error is a `RolloutValidationError` naming sample and position): length
mismatches between output_ids / output_token_logprobs / output_top_logprobs, sampled-id mismatch,
missing top-K when K > 0, ids outside [0, vocab_size), duplicate ids at a position, NaN/inf
logprobs on valid slots, and sum of mu over the support > 1 + 1e-4. Short or ragged top-K lists
are not errors: the missing slots become invalid and are counted in `meta_info`. A top-K entry with
logprob -inf (probability 0, only possible through a non-strict JSON encoder) is made invalid too.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
from typing import Any

import numpy as np
import orjson
import pybase64
import torch

from rollout_bridge.types import RolloutSample, RolloutValidationError

logger = logging.getLogger(__name__)

SUM_MU_TOLERANCE = 1e-4
_chain = itertools.chain.from_iterable


class MalformedResponseError(RolloutValidationError):
    """The body is not valid JSON or not a /generate response (retryable by the client)."""


@contextlib.contextmanager
def gc_paused():
    """Pauses Python's cyclic garbage collector around a large JSON decode.

    A K=20 x 8k-token body decodes into ~700k Python objects; every 700 allocations the collector
    runs and, in a process holding torch's large heap, a full collection scans all of it. Measured
    on a 5.5 MB body: orjson.loads 95 ms with the collector on, 44 ms paused (more inside a
    trainer process). The decoded JSON tree holds no reference cycles, so pausing creates no
    uncollectable garbage; the previous state is restored on exit.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
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


def _floats(items: list, count: int) -> np.ndarray:
    """[count] float64 from a list of numbers; JSON null becomes NaN (caught by validation)."""
    try:
        return np.fromiter(items, dtype=np.float64, count=count)
    except TypeError:
        return np.array(items, dtype=np.float64)


def _ints(items: list, count: int, what: str, sample_index: int) -> np.ndarray:
    try:
        return np.fromiter(items, dtype=np.int64, count=count)
    except (TypeError, ValueError):
        bad = next(i for i, x in enumerate(items) if not isinstance(x, int))
        raise RolloutValidationError(f"non-integer token id {items[bad]!r} in {what}",
                                     sample_index, bad) from None


def _first(mask: np.ndarray) -> int:
    """Index of the first True row of a [T] or [T, S] mask."""
    if mask.ndim > 1:
        mask = mask.any(axis=1)
    return int(np.flatnonzero(mask)[0])


def fold_support(top_ids: np.ndarray, top_lp: np.ndarray, top_valid: np.ndarray,
                 sampled_ids: np.ndarray, sampled_lp: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Folds the sampled token into the top-K support (algorithms.md §3.9).

    Args:
        top_ids: [T, K] int top-K ids in rank order (any value on invalid slots).
        top_lp: [T, K] float top-K logprobs.
        top_valid: [T, K] bool.
        sampled_ids: [T] int sampled ids.
        sampled_lp: [T] float sampled-token logprobs (independently returned).

    Returns:
        (support_ids [T, K+1] int32, support_logprobs [T, K+1] fp32, support_valid [T, K+1] bool,
        number of positions whose sampled token was inside the top-K).
    """
    t, k = top_ids.shape
    ids_ts = np.empty((t, k + 1), dtype=np.int32)
    lp_ts = np.empty((t, k + 1), dtype=np.float32)
    valid_ts = np.empty((t, k + 1), dtype=bool)
    all_valid = bool(top_valid.all())
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


def validate_support(ids_ts: np.ndarray, lp_ts: np.ndarray, valid_ts: np.ndarray,
                     sampled_ids: np.ndarray, sampled_lp: np.ndarray, vocab_size: int | None,
                     sample_index: int) -> None:
    """Checks a folded support; raises `RolloutValidationError` at the first bad position.

    Args:
        ids_ts, lp_ts, valid_ts: [T, S] folded support (see `fold_support`).
        sampled_ids: [T] sampled ids; sampled_lp: [T] sampled logprobs.
        vocab_size: Engine vocabulary; None skips the upper range check.
        sample_index: Reported in errors.
    """
    if ids_ts.shape[0] == 0:
        return
    bad_t = ~np.isfinite(sampled_lp)
    if bad_t.any():
        p = _first(bad_t)
        raise RolloutValidationError(f"sampled-token logprob {sampled_lp[p]} is not finite",
                                     sample_index, p)
    bad_t = sampled_lp > 1e-6
    if bad_t.any():
        p = _first(bad_t)
        raise RolloutValidationError(f"sampled-token logprob {sampled_lp[p]} > 0",
                                     sample_index, p)
    bad_ts = valid_ts & ~np.isfinite(lp_ts)
    if bad_ts.any():
        p = _first(bad_ts)
        raise RolloutValidationError(f"non-finite top-K logprob {lp_ts[p][bad_ts[p]][0]}",
                                     sample_index, p)
    out_of_range = (ids_ts < 0) if vocab_size is None else ((ids_ts < 0) | (ids_ts >= vocab_size))
    bad_ts = valid_ts & out_of_range
    if bad_ts.any():
        p = _first(bad_ts)
        raise RolloutValidationError(
            f"token id {ids_ts[p][bad_ts[p]][0]} outside [0, {vocab_size})", sample_index, p)
    # Duplicates: sort each row with invalid slots replaced by distinct negative sentinels.
    s = ids_ts.shape[1]
    keyed_ts = np.where(valid_ts, ids_ts, -1 - np.arange(s, dtype=np.int32))
    keyed_ts.sort(axis=1)
    dup_t = (keyed_ts[:, 1:] == keyed_ts[:, :-1]).any(axis=1)
    if dup_t.any():
        p = _first(dup_t)
        row = keyed_ts[p]
        dup_id = row[1:][row[1:] == row[:-1]][0]
        raise RolloutValidationError(f"duplicate token id {dup_id} in the support",
                                     sample_index, p)
    mass_t = np.exp(lp_ts.astype(np.float64)).sum(axis=1)  # invalid slots are -inf -> 0
    bad_t = mass_t > 1.0 + SUM_MU_TOLERANCE
    if bad_t.any():
        p = _first(bad_t)
        raise RolloutValidationError(
            f"support probability mass {mass_t[p]:.6f} > 1 + {SUM_MU_TOLERANCE} (temperature or "
            "top-p mismatch?)", sample_index, p)


def _sort_rank_order(ids_tk: np.ndarray, lp_tk: np.ndarray, valid_tk: np.ndarray):
    """Puts each row in descending-logprob order with invalid slots last (no-op when sorted)."""
    key_tk = np.where(valid_tk, lp_tk, -np.inf)
    if valid_tk.all() and (key_tk[:, :-1] >= key_tk[:, 1:]).all():
        return ids_tk, lp_tk, valid_tk
    order_tk = np.argsort(-key_tk, axis=1, kind="stable")
    order_tk = np.where(valid_tk.any(axis=1, keepdims=True), order_tk, np.arange(ids_tk.shape[1]))
    take = lambda a: np.take_along_axis(a, order_tk, axis=1)  # noqa: E731
    return take(ids_tk), take(lp_tk), take(valid_tk)


def _parse_top(top: list, t: int, k: int, sample_index: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Nested `output_top_logprobs` [T][<=K][3] -> ([T,K] ids, [T,K] logprobs, [T,K] valid)."""
    try:
        lens_t = np.fromiter(map(len, top), dtype=np.int64, count=t)
    except TypeError:  # null rows
        lens_t = np.array([0 if row is None else len(row) for row in top], dtype=np.int64)
    stats = {"num_short_positions": int((lens_t < k).sum()),
             "num_missing_topk_slots": int(np.clip(k - lens_t, 0, None).sum()),
             "num_truncated_positions": int((lens_t > k).sum())}
    if stats["num_short_positions"] == 0 and stats["num_truncated_positions"] == 0:
        flat = list(_chain(_chain(top)))
        n = t * k
        if len(flat) == 3 * n:
            ids_tk = _ints(flat[1::3], n, "output_top_logprobs", sample_index).reshape(t, k)
            lp_tk = _floats(flat[0::3], n).reshape(t, k)
            return ids_tk, lp_tk, np.ones((t, k), dtype=bool), stats
    # General path: ragged, null or over-long rows (still C-level flattening).
    lens_t = np.minimum(lens_t, k)
    rows = [row[:k] if row else () for row in top] if stats["num_truncated_positions"] else \
        [row or () for row in top]
    triples = list(_chain(rows))
    n = len(triples)
    flat = list(_chain(triples))
    if len(flat) != 3 * n:
        flat = list(_chain((tr[0], tr[1], None) for tr in triples))
    ids_n = _ints(flat[1::3], n, "output_top_logprobs", sample_index)
    lp_n = _floats(flat[0::3], n)
    starts_t = np.cumsum(lens_t) - lens_t
    pos_n = np.repeat(np.arange(t), lens_t)
    slot_n = np.arange(n) - np.repeat(starts_t, lens_t)
    ids_tk = np.zeros((t, k), dtype=np.int64)
    lp_tk = np.full((t, k), -np.inf)
    valid_tk = np.zeros((t, k), dtype=bool)
    ids_tk[pos_n, slot_n] = ids_n
    lp_tk[pos_n, slot_n] = lp_n
    valid_tk[pos_n, slot_n] = True
    return ids_tk, lp_tk, valid_tk, stats


def _finish_reason(meta: dict) -> str:
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):
        return str(fr.get("type", "unknown"))
    return "unknown" if fr is None else str(fr)


def _sampled(meta: dict, obj: dict, sample_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sampled ids [T] and logprobs [T] from output_token_logprobs, checked against output_ids."""
    otl = meta.get("output_token_logprobs")
    if otl is None:
        raise RolloutValidationError("missing meta_info.output_token_logprobs "
                                     "(request return_logprob=true)", sample_index)
    t = len(otl)
    flat = list(_chain(otl))
    if len(flat) != 3 * t:
        flat = list(_chain((tr[0], tr[1], None) for tr in otl))
    sampled_ids = _ints(flat[1::3], t, "output_token_logprobs", sample_index)
    sampled_lp = _floats(flat[0::3], t)
    out_ids = obj.get("output_ids")
    if out_ids is not None:
        if len(out_ids) != t:
            raise RolloutValidationError(
                f"length mismatch: output_ids has {len(out_ids)} tokens, output_token_logprobs "
                f"{t}", sample_index, min(len(out_ids), t))
        out_ids_t = _ints(out_ids, t, "output_ids", sample_index)
        bad_t = out_ids_t != sampled_ids
        if bad_t.any():
            p = _first(bad_t)
            raise RolloutValidationError(
                f"sampled id mismatch: output_ids has {out_ids_t[p]}, output_token_logprobs "
                f"{sampled_ids[p]}", sample_index, p)
    return sampled_ids, sampled_lp


def _to_sample(sampled_ids, sampled_lp, ids_ts, lp_ts, valid_ts, reason: str,
               meta_info: dict) -> RolloutSample:
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


_META_KEYS = ("id", "weight_version", "prompt_tokens", "completion_tokens", "cached_tokens",
              "e2e_latency")


def _flat_output_top(meta: dict, t: int, top_k: int, sample_index: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Output-side flat top-K -> ([T,K] ids, [T,K] logprobs, [T,K] valid, stats).

    Row r is output position null_prefix + r; positions before null_prefix have no top-K
    (invalid slots, counted as short). -inf entries become invalid slots; NaN is an error.
    """
    vals_rk, idx_rk, null_prefix = decode_flat_topk(meta, sample_index, side="output")
    rows, k = vals_rk.shape
    if null_prefix + rows != t:
        raise RolloutValidationError(
            f"length mismatch: flat output top-K covers {null_prefix} + {rows} positions, "
            f"output_token_logprobs {t}", sample_index, min(null_prefix + rows, t))
    kk = min(k, top_k)
    ids_tk = np.zeros((t, top_k), dtype=np.int64)
    lp_tk = np.full((t, top_k), -np.inf, dtype=np.float32)
    ids_tk[null_prefix:, :kk] = idx_rk[:, :kk]
    lp_tk[null_prefix:, :kk] = vals_rk[:, :kk]
    if np.isnan(lp_tk).any():
        p = _first(np.isnan(lp_tk))
        raise RolloutValidationError("NaN top-K logprob", sample_index, p)
    valid_tk = np.isfinite(lp_tk)
    short = null_prefix + (rows if k < top_k else 0)
    stats = {"num_short_positions": short,
             "num_missing_topk_slots": int(null_prefix * top_k + rows * max(0, top_k - k)),
             "num_truncated_positions": rows if k > top_k else 0,
             "num_neg_inf_slots": int(np.isneginf(vals_rk[:, :kk]).sum())}
    ids_tk, lp_tk, valid_tk = _sort_rank_order(ids_tk, lp_tk, valid_tk)
    return ids_tk, lp_tk, valid_tk, stats


def parse_response_object(obj: Any, top_k: int, vocab_size: int | None = None,
                          sample_index: int = 0, validate: bool = True) -> RolloutSample:
    """Parses one decoded `/generate` response object (see `parse_generate_response`)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("meta_info"), dict):
        raise MalformedResponseError("not a /generate response object (no meta_info): "
                                     f"{str(obj)[:200]}", sample_index)
    meta = obj["meta_info"]
    reason = _finish_reason(meta)
    sampled_ids, sampled_lp = _sampled(meta, obj, sample_index)
    t = sampled_ids.shape[0]
    info = {key: meta[key] for key in _META_KEYS if key in meta}
    info["finish_reason_raw"] = meta.get("finish_reason")
    stats = {"num_short_positions": 0, "num_missing_topk_slots": 0, "num_truncated_positions": 0}
    if top_k > 0 and has_flat_topk(meta, "output"):
        ids_tk, lp_tk, valid_tk, stats = _flat_output_top(meta, t, top_k, sample_index)
    elif top_k > 0:
        top = meta.get("output_top_logprobs")
        if top is None and t > 0:
            raise RolloutValidationError(
                f"missing meta_info.output_top_logprobs with top_k={top_k} (request "
                "top_logprobs_num)", sample_index, 0)
        top = top or []
        if len(top) != t:
            raise RolloutValidationError(
                f"length mismatch: output_top_logprobs has {len(top)} positions, "
                f"output_token_logprobs {t}", sample_index, min(len(top), t))
        ids_tk, lp_tk, valid_tk, stats = _parse_top(top, t, top_k, sample_index)
        if np.isnan(lp_tk).any():
            p = _first(np.isnan(lp_tk))
            raise RolloutValidationError("NaN or null top-K logprob", sample_index, p)
        neg_inf_tk = valid_tk & np.isneginf(lp_tk)
        stats["num_neg_inf_slots"] = int(neg_inf_tk.sum())
        if stats["num_neg_inf_slots"]:
            valid_tk = valid_tk & ~neg_inf_tk
        ids_tk, lp_tk, valid_tk = _sort_rank_order(ids_tk, lp_tk, valid_tk)
    else:
        ids_tk = np.zeros((t, 0), dtype=np.int64)
        lp_tk = np.zeros((t, 0))
        valid_tk = np.zeros((t, 0), dtype=bool)
    ids_ts, lp_ts, valid_ts, n_in = fold_support(ids_tk, lp_tk, valid_tk, sampled_ids, sampled_lp)
    if validate:
        validate_support(ids_ts, lp_ts, valid_ts, sampled_ids, sampled_lp, vocab_size,
                         sample_index)
    info.update(stats)
    info["sampled_in_topk"] = n_in
    return _to_sample(sampled_ids, sampled_lp, ids_ts, lp_ts, valid_ts, reason, info)


def parse_generate_response(body: bytes | str | dict | list, top_k: int = 20,
                            vocab_size: int | None = None, *,
                            validate: bool = True) -> list[RolloutSample]:
    """Parses the body of one SGLang `/generate` response into samples.

    Args:
        body: Response bytes/str (an object, or a list for a batched request); an already
            decoded object or list is accepted too.
        top_k: K requested as `top_logprobs_num` (0: sampled token only, S = 1).
        vocab_size: Engine vocabulary for the id range check (None: only ids >= 0 checked).
        validate: Run `validate_support` (structural checks always run).

    Returns:
        One `RolloutSample` per response object, with response_ids [T], behavior_logprob [T],
        support_ids [T, K+1] int32, support_logprobs [T, K+1] fp32, support_valid [T, K+1] and
        finish_reason. `prompt_ids` is empty (SGLang does not echo it); the client fills it.

    Raises:
        RolloutValidationError: Naming the sample index and token position
            (`MalformedResponseError` for bodies that are not /generate JSON).
    """
    # The whole decode + flatten runs with the collector paused, and the decoded tree is released
    # before it resumes, so no collection ever scans it (see `gc_paused`).
    with gc_paused():
        obj = loads(body) if isinstance(body, (bytes, bytearray, memoryview, str)) else body
        if isinstance(obj, dict) and "meta_info" not in obj and "error" in obj:
            raise MalformedResponseError(f"server error response: {str(obj['error'])[:300]}")
        objs = obj if isinstance(obj, list) else [obj]
        samples = [parse_response_object(o, top_k, vocab_size, i, validate)
                   for i, o in enumerate(objs)]
        del obj, objs
    return samples


# --------------------------------------------------------------------------- binary path


def has_flat_topk(meta: dict, side: str) -> bool:
    """Whether `meta` carries SGLang's flat top-K for `side` ("input" or "output")."""
    return (f"{side}_top_logprobs_val_flat_b64" in meta
            or f"{side}_top_logprobs_val_flat" in meta)


def decode_flat_topk(meta: dict, sample_index: int = 0, side: str = "input"
                     ) -> tuple[np.ndarray, np.ndarray, int]:
    """Decodes SGLang's flat top-K of one side; base64 arrays without copying.

    Fields `{side}_top_logprobs_{val,idx}_flat_b64` (+ `_dtype`, little-endian) or the plain
    JSON lists `{side}_top_logprobs_{val,idx}_flat`, with `{side}_top_logprobs_shape` [rows, k]
    and `{side}_top_logprobs_null_prefix`. Entry j of covered position i is at
    flat[(i - null_prefix) * k + j] (ecosystem §4.2). side="output" exists since SGLang 0.5.2x
    (`return_flat_raw_output_top_logprobs`, finished non-streaming responses only).

    Returns:
        (values [rows, k] fp32, ids [rows, k] int32, null_prefix); read-only views for base64.
    """
    try:
        shape = meta[f"{side}_top_logprobs_shape"]
        if f"{side}_top_logprobs_val_flat_b64" in meta:
            val_b64 = meta[f"{side}_top_logprobs_val_flat_b64"]
            idx_b64 = meta[f"{side}_top_logprobs_idx_flat_b64"]
        else:
            val_b64 = idx_b64 = None
            val_list = meta[f"{side}_top_logprobs_val_flat"]
            idx_list = meta[f"{side}_top_logprobs_idx_flat"]
    except KeyError as exc:
        raise MalformedResponseError(
            f"response lacks {exc.args[0]} (request return_flat_raw_"
            f"{'output_' if side == 'output' else ''}top_logprobs)", sample_index) from None
    rows, k = int(shape[0]), int(shape[1])
    if val_b64 is not None:
        val_name = meta.get(f"{side}_top_logprobs_val_flat_b64_dtype", "float32")
        idx_name = meta.get(f"{side}_top_logprobs_idx_flat_b64_dtype", "int32")
        val_dtype = np.dtype(val_name).newbyteorder("<")
        idx_dtype = np.dtype(idx_name).newbyteorder("<")
        vals = np.frombuffer(pybase64.b64decode(val_b64), dtype=val_dtype)
        idx = np.frombuffer(pybase64.b64decode(idx_b64), dtype=idx_dtype)
    else:
        vals = _floats(val_list, len(val_list)).astype(np.float32)
        idx = _ints(idx_list, len(idx_list), f"{side}_top_logprobs_idx_flat", sample_index)
    if vals.size != rows * k or idx.size != rows * k:
        raise RolloutValidationError(
            f"flat top-K has {vals.size} values / {idx.size} ids, shape says {rows}x{k}",
            sample_index)
    return vals.reshape(rows, k), idx.reshape(rows, k), int(meta.get(
        f"{side}_top_logprobs_null_prefix", 0) or 0)


def scoring_rows(prompt_len: int, num_response: int, logprob_start_len: int,
                 null_prefix: int) -> np.ndarray:
    """Flat-array rows that score the response tokens of a scoring request.

    The scoring request sends input_ids = prompt + response. Covered input positions start at
    `logprob_start_len`; the first `null_prefix` covered positions have no row (position 0 has no
    predictor). The row of input position q is the distribution of the token *at* q (computed
    from the logits of q - 1), so response token t (input position prompt_len + t) is scored by
    row prompt_len + t - logprob_start_len - null_prefix.

    Returns:
        [T] int64 row indices.
    """
    first = prompt_len - logprob_start_len - null_prefix
    if first < 0:
        raise ValueError(f"scoring request does not cover the response: prompt_len={prompt_len}, "
                         f"logprob_start_len={logprob_start_len}, null_prefix={null_prefix}")
    return first + np.arange(num_response, dtype=np.int64)


def parse_scoring_response(body: bytes | str | dict | list, samples: list[RolloutSample],
                           top_k: int, vocab_size: int | None = None, *,
                           logprob_start_lens: list[int] | None = None,
                           validate: bool = True) -> list[RolloutSample]:
    """Attaches the flat base64 top-K of a scoring request to already parsed samples.

    The scoring request (one item per sample) is: input_ids = prompt + response,
    `max_new_tokens=0`, `logprob_start_len=len(prompt)`, `top_logprobs_num=K`,
    `return_flat_raw_top_logprobs_b64=true`. The sampled-token logprob stays the one from the
    generation (`behavior_logprob`); it is folded into the prefill top-K as usual.

    Args:
        body: Scoring response (list for batched requests, in `samples` order).
        samples: Samples from the generation response; their `prompt_ids` must be set.
        top_k: K (the flat shape's k must be >= K; extra columns are ignored).
        vocab_size: For validation.
        logprob_start_lens: Per-sample logprob_start_len used (default: each prompt length).
        validate: Run `validate_support`.

    Returns:
        The same sample objects, with support_* replaced (shape [T, K+1]).
    """
    # decode and fold with the collector paused; the tree is released before it resumes
    with gc_paused():
        _attach_scoring(body, samples, top_k, vocab_size, logprob_start_lens, validate)
    return samples


def _attach_scoring(body, samples, top_k, vocab_size, logprob_start_lens, validate) -> None:
    obj = loads(body) if isinstance(body, (bytes, bytearray, memoryview, str)) else body
    objs = obj if isinstance(obj, list) else [obj]
    if len(objs) != len(samples):
        raise MalformedResponseError(f"scoring response has {len(objs)} items for "
                                     f"{len(samples)} samples")
    for i, (o, sample) in enumerate(zip(objs, samples)):
        if not isinstance(o, dict) or not isinstance(o.get("meta_info"), dict):
            raise MalformedResponseError("not a /generate response object", i)
        vals_rk, idx_rk, null_prefix = decode_flat_topk(o["meta_info"], i)
        if idx_rk.shape[1] < top_k:
            raise RolloutValidationError(f"flat top-K has k={idx_rk.shape[1]} < {top_k}", i)
        p = int(sample.prompt_ids.shape[0])
        t = sample.num_tokens
        start = p if logprob_start_lens is None else int(logprob_start_lens[i])
        rows_t = scoring_rows(p, t, start, null_prefix)
        if t and rows_t[-1] >= vals_rk.shape[0]:
            raise RolloutValidationError(
                f"flat top-K has {vals_rk.shape[0]} rows, response needs {rows_t[-1] + 1}", i,
                int(vals_rk.shape[0] - rows_t[0]))
        ids_tk = idx_rk[rows_t, :top_k]
        lp_tk = vals_rk[rows_t, :top_k]
        valid_tk = np.isfinite(lp_tk) | np.isnan(lp_tk)  # -inf -> invalid; NaN -> error below
        ids_tk, lp_tk, valid_tk = _sort_rank_order(ids_tk, lp_tk, valid_tk)
        sampled_ids = sample.response_ids.numpy()
        sampled_lp = sample.behavior_logprob.numpy().astype(np.float64)
        ids_ts, lp_ts, valid_ts, n_in = fold_support(ids_tk, lp_tk, valid_tk, sampled_ids,
                                                     sampled_lp)
        if validate:
            validate_support(ids_ts, lp_ts, valid_ts, sampled_ids, sampled_lp, vocab_size, i)
        sample.support_ids = torch.from_numpy(ids_ts)
        sample.support_logprobs = torch.from_numpy(lp_ts)
        sample.support_valid = torch.from_numpy(valid_ts)
        sample.meta_info["sampled_in_topk"] = n_in
        sample.meta_info["topk_transport"] = "scoring_b64"
        sample.meta_info["num_neg_inf_slots"] = int((~valid_tk).sum())
