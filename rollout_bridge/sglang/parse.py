"""Fast, validated parsing of SGLang `/generate` responses into rollout samples.

What: `parse_generate_response` turns the bytes of one `/generate` response (nested
`[logprob, id, null]` triples, or the flat output-side arrays of `parse_flat.py`) into
`RolloutSample`s with the K+1 support layout of docs/math.md §3.9 (folding and checks:
`megatron_pdm.ops.support`, shared with every engine).

Why this shape: at K=20 and 8k tokens a response is ~6 MB of JSON and decoding it dominates the
rollout->trainer path. The JSON path makes exactly one `orjson.loads` and then reads the
nested triples with C-level iterators: each position's list is flattened once into one list of
entry references (`itertools.chain`), `map(itemgetter(0 / 1), ...)` over it gives a logprob list
and an id list (`core/decode.py: pair_columns`), every value's type is checked on those two flat
lists (one C-level count each) and numpy is filled with `np.fromiter`, so no Python code runs per
triple; all folding and
validation is vectorized numpy. The binary path decodes base64 straight into numpy
(`np.frombuffer`, no copy).

Validation (every error is a `RolloutValidationError` naming sample and position): length
mismatches between output_ids / output_token_logprobs / output_top_logprobs, sampled-id mismatch,
missing top-K when K > 0, ids outside [0, vocab_size), duplicate ids at a position, NaN/inf
logprobs on valid slots, and sum of mu over the support > 1 + SUM_MU_TOLERANCE. Short or ragged
top-K lists
are not errors: the missing slots become invalid and are counted in `meta_info`. A top-K entry with
logprob -inf (probability 0, only possible through a non-strict JSON encoder) is made invalid too.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np

from rollout_bridge.core.decode import (
    MalformedResponseError,
    check_topk_values,
    checked_list,
    first,
    folded_support,
    gc_paused,
    ints,
    loads,
    pair_columns,
    preview,
    row_locator,
    sort_rank_order,
    text,
    to_sample,
)
from rollout_bridge.sglang.parse_flat import flat_output_top, has_flat_topk
from rollout_bridge.core.types import RolloutSample, RolloutValidationError

__all__ = ["MalformedResponseError", "loads", "parse_generate_response", "parse_response_object"]

logger = logging.getLogger(__name__)

_chain = itertools.chain.from_iterable


_ROW_TYPES = frozenset({list, type(None)})
_TOP = "meta_info.output_top_logprobs"


def _parse_top(top: list, t: int, k: int, sample_index: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Nested `output_top_logprobs` [T][<=K][3] -> ([T,K] ids, [T,K] logprobs, [T,K] valid)."""
    if not set(map(type, top)) <= _ROW_TYPES:
        p = next(p for p, row in enumerate(top) if type(row) not in _ROW_TYPES)
        checked_list(top[p], f"{_TOP} row", sample_index, p)
    if None in top:  # null rows (no top-K at that position)
        lens_t = np.array([0 if row is None else len(row) for row in top], dtype=np.int64)
    else:
        lens_t = np.fromiter(map(len, top), dtype=np.int64, count=t)
    stats = {"num_short_positions": int((lens_t < k).sum()),
             "num_missing_topk_slots": int(np.clip(k - lens_t, 0, None).sum()),
             "num_truncated_positions": int((lens_t > k).sum())}
    if stats["num_short_positions"] == 0 and stats["num_truncated_positions"] == 0:
        # each position's list flattened once (references only); the columns come off it
        ids_n, lp_n = pair_columns(list(_chain(top)), t * k, _TOP, sample_index,
                                   lambda j: (j // k, j % k))
        return ids_n.reshape(t, k), lp_n.reshape(t, k), np.ones((t, k), dtype=bool), stats
    # General path: ragged, null or over-long rows (still C-level flattening).
    lens_t = np.minimum(lens_t, k)
    rows = [row[:k] if row else () for row in top] if stats["num_truncated_positions"] else \
        [row or () for row in top]
    n = int(lens_t.sum())
    ids_n, lp_n = pair_columns(list(_chain(rows)), n, _TOP, sample_index,
                               row_locator(lens_t))
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
        return text(fr.get("type", "unknown"))
    return "unknown" if fr is None else text(fr)


_OTL = "meta_info.output_token_logprobs"


def _sampled(meta: dict, obj: dict, sample_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Sampled ids [T] and logprobs [T] from output_token_logprobs, checked against output_ids."""
    otl = meta.get("output_token_logprobs")
    if otl is None:
        raise RolloutValidationError("missing meta_info.output_token_logprobs "
                                     "(request return_logprob=true)", sample_index)
    otl = checked_list(otl, _OTL, sample_index)
    t = len(otl)
    sampled_ids, sampled_lp = pair_columns(otl, t, _OTL, sample_index)
    out_ids = obj.get("output_ids")
    if out_ids is not None:
        out_ids = checked_list(out_ids, "output_ids", sample_index)
        if len(out_ids) != t:
            raise RolloutValidationError(
                f"length mismatch: output_ids has {len(out_ids)} tokens, output_token_logprobs "
                f"{t}", sample_index, min(len(out_ids), t))
        out_ids_t = ints(out_ids, t, "output_ids", sample_index)
        bad_t = out_ids_t != sampled_ids
        if bad_t.any():
            p = first(bad_t)
            raise RolloutValidationError(
                f"sampled id mismatch: output_ids has {out_ids_t[p]}, output_token_logprobs "
                f"{sampled_ids[p]}", sample_index, p)
    return sampled_ids, sampled_lp


_META_KEYS = ("id", "weight_version", "prompt_tokens", "completion_tokens", "cached_tokens",
              "e2e_latency")


def parse_response_object(obj: Any, top_logprobs: int, vocab_size: int | None = None,
                          sample_index: int = 0, validate: bool = True) -> RolloutSample:
    """Parses one decoded `/generate` response object (see `parse_generate_response`)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("meta_info"), dict):
        raise MalformedResponseError("not a /generate response object (no meta_info): "
                                     f"{preview(obj)}", sample_index)
    meta = obj["meta_info"]
    reason = _finish_reason(meta)
    sampled_ids, sampled_lp = _sampled(meta, obj, sample_index)
    t = sampled_ids.shape[0]
    info = {key: meta[key] for key in _META_KEYS if key in meta}
    info["finish_reason_raw"] = meta.get("finish_reason")
    stats = {"num_short_positions": 0, "num_missing_topk_slots": 0, "num_truncated_positions": 0}
    if top_logprobs > 0 and has_flat_topk(meta, "output"):
        ids_tk, lp_tk, valid_tk, stats = flat_output_top(meta, t, top_logprobs, sample_index)
    elif top_logprobs > 0:
        top = meta.get("output_top_logprobs")
        if top is None and t > 0:
            raise RolloutValidationError(
                f"missing meta_info.output_top_logprobs with top_logprobs={top_logprobs} (request "
                "top_logprobs_num)", sample_index, 0)
        top = [] if top is None else checked_list(top, _TOP, sample_index)
        if len(top) != t:
            raise RolloutValidationError(
                f"length mismatch: output_top_logprobs has {len(top)} positions, "
                f"output_token_logprobs {t}", sample_index, min(len(top), t))
        ids_tk, lp_tk, present_tk, stats = _parse_top(top, t, top_logprobs, sample_index)
        valid_tk = check_topk_values(lp_tk, present_tk, sample_index)
        stats["num_neg_inf_slots"] = int((present_tk & ~valid_tk).sum())
        ids_tk, lp_tk, valid_tk = sort_rank_order(ids_tk, lp_tk, valid_tk)
    else:
        ids_tk = np.zeros((t, 0), dtype=np.int64)
        lp_tk = np.zeros((t, 0))
        valid_tk = np.zeros((t, 0), dtype=bool)
    ids_ts, lp_ts, valid_ts, n_in = folded_support(ids_tk, lp_tk, valid_tk, sampled_ids,
                                                   sampled_lp, vocab_size, sample_index, validate)
    info.update(stats)
    info["sampled_in_topk"] = n_in
    return to_sample(sampled_ids, sampled_lp, ids_ts, lp_ts, valid_ts, reason, info)


def parse_generate_response(body: bytes | str | dict | list, top_logprobs: int = 20,
                            vocab_size: int | None = None, *,
                            validate: bool = True) -> list[RolloutSample]:
    """Parses the body of one SGLang `/generate` response into samples.

    Args:
        body: Response bytes/str (an object, or a list for a batched request); an already
            decoded object or list is accepted too.
        top_logprobs: K requested as `top_logprobs_num` (0: sampled token only, S = 1).
        vocab_size: Engine vocabulary for the id range check (None: only ids >= 0 checked).
        validate: Check the support contract (`megatron_pdm.ops.support.check_support`);
            structural checks always run.

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
            raise MalformedResponseError(f"server error response: {text(obj['error'])[:300]}")
        objs = obj if isinstance(obj, list) else [obj]
        samples = [parse_response_object(o, top_logprobs, vocab_size, i, validate)
                   for i, o in enumerate(objs)]
        del obj, objs
    return samples


