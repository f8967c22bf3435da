"""SGLang's flat top-K format (JSON lists or base64 arrays), output side and scoring requests.

What: `decode_flat_topk` reads `{side}_top_logprobs_{val,idx}_flat[_b64]` with its shape and
null prefix (base64 decoded straight into numpy, no copy); `flat_output_top` turns the output side
of a /generate response into [T, K] top-K arrays; `parse_scoring_response` attaches the top-K of a
prefill-only scoring request to already parsed samples.
"""

from __future__ import annotations

import binascii
from typing import Any

import numpy as np
import pybase64
import torch

from rollout_bridge.core.decode import (
    MalformedResponseError,
    check_topk_values,
    checked_list,
    floats,
    folded_support,
    gc_paused,
    ints,
    loads,
    preview,
    sort_rank_order,
)
from rollout_bridge.core.types import RolloutSample, RolloutValidationError


def flat_output_top(meta: dict, t: int, top_logprobs: int, sample_index: int
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
    kk = min(k, top_logprobs)
    ids_tk = np.zeros((t, top_logprobs), dtype=np.int64)
    lp_tk = np.full((t, top_logprobs), -np.inf, dtype=np.float32)
    present_tk = np.zeros((t, top_logprobs), dtype=bool)
    ids_tk[null_prefix:, :kk] = idx_rk[:, :kk]
    lp_tk[null_prefix:, :kk] = vals_rk[:, :kk]
    present_tk[null_prefix:, :kk] = True
    # -inf -> invalid slot; NaN and +inf are errors, exactly as on the JSON path
    valid_tk = check_topk_values(lp_tk, present_tk, sample_index)
    short = null_prefix + (rows if k < top_logprobs else 0)
    stats = {"num_short_positions": short,
             "num_missing_topk_slots": int(null_prefix * top_logprobs
                                           + rows * max(0, top_logprobs - k)),
             "num_truncated_positions": rows if k > top_logprobs else 0,
             "num_neg_inf_slots": int((present_tk & ~valid_tk).sum())}
    ids_tk, lp_tk, valid_tk = sort_rank_order(ids_tk, lp_tk, valid_tk)
    return ids_tk, lp_tk, valid_tk, stats


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
    flat[(i - null_prefix) * k + j] (docs/engines.md, SGLang). side="output" exists since SGLang
    0.5.22
    (`return_flat_raw_output_top_logprobs`, finished non-streaming responses only).

    Returns:
        (values [rows, k] fp32, ids [rows, k] int32, null_prefix); read-only views for base64.
    """
    try:
        shape = meta[f"{side}_top_logprobs_shape"]
        is_b64 = f"{side}_top_logprobs_val_flat_b64" in meta
        if is_b64:
            val_b64 = meta[f"{side}_top_logprobs_val_flat_b64"]
            idx_b64 = meta[f"{side}_top_logprobs_idx_flat_b64"]
        else:
            val_list = meta[f"{side}_top_logprobs_val_flat"]
            idx_list = meta[f"{side}_top_logprobs_idx_flat"]
    except KeyError as exc:
        raise MalformedResponseError(
            f"response lacks {exc.args[0]} (request return_flat_raw_"
            f"{'output_' if side == 'output' else ''}top_logprobs)", sample_index) from None
    prefix = f"meta_info.{side}_top_logprobs"
    if type(shape) is not list or len(shape) != 2 or not all(
            type(n) is int and 0 <= n < _MAX_DIM for n in shape):
        raise RolloutValidationError(f"{prefix}_shape {preview(shape)} is not [rows, k] (two "
                                     "non-negative integers)", sample_index)
    rows, k = shape
    null_prefix = meta.get(f"{side}_top_logprobs_null_prefix", 0)
    null_prefix = 0 if null_prefix is None else null_prefix
    if type(null_prefix) is not int or not 0 <= null_prefix < _MAX_DIM:
        raise RolloutValidationError(f"{prefix}_null_prefix {preview(null_prefix)} is not a "
                                     "non-negative integer", sample_index)
    # row r of the arrays is output position null_prefix + r (prompt side: not a response position)
    base = null_prefix if side == "output" else None
    if is_b64:
        vals = _b64_array(meta, f"{side}_top_logprobs_val_flat_b64", val_b64, "float32",
                          _VAL_DTYPES, sample_index)
        idx = _b64_array(meta, f"{side}_top_logprobs_idx_flat_b64", idx_b64, "int32",
                         _IDX_DTYPES, sample_index)
    else:
        val_list = checked_list(val_list, f"{prefix}_val_flat", sample_index)
        idx_list = checked_list(idx_list, f"{prefix}_idx_flat", sample_index)
        if len(val_list) != rows * k or len(idx_list) != rows * k:
            raise RolloutValidationError(
                f"flat top-K has {len(val_list)} values / {len(idx_list)} ids, shape says "
                f"{rows}x{k}", sample_index)
        locate = (lambda j: (base + j // k, j % k)) if base is not None else \
            (lambda j: (None, j))
        with np.errstate(over="ignore"):  # beyond fp32: +-inf, refused by the value checks
            vals = floats(val_list, len(val_list), f"{prefix}_val_flat", sample_index,
                          locate).astype(np.float32)
        idx = ints(idx_list, len(idx_list), f"{prefix}_idx_flat", sample_index, locate)
    if vals.size != rows * k or idx.size != rows * k:
        raise RolloutValidationError(
            f"flat top-K has {vals.size} values / {idx.size} ids, shape says {rows}x{k}",
            sample_index)
    return vals.reshape(rows, k), idx.reshape(rows, k), null_prefix


_MAX_DIM = 2**31
_VAL_DTYPES = ("float32", "float16", "float64")
_IDX_DTYPES = ("int32", "int64")


def _b64_array(meta: dict, key: str, data: Any, default: str, allowed: tuple[str, ...],
               sample_index: int) -> np.ndarray:
    """One base64 flat array (little-endian `{key}_dtype`, one of `allowed`), without a copy."""
    name = meta.get(f"{key}_dtype", default)
    if name not in allowed:  # (SGLang sends float32 / int32)
        raise RolloutValidationError(f"meta_info.{key}_dtype {preview(name)} is not one of "
                                     f"{list(allowed)}", sample_index)
    if type(data) is not str:
        raise RolloutValidationError(f"meta_info.{key} is not a base64 string", sample_index)
    try:
        raw = pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RolloutValidationError(f"meta_info.{key} is not valid base64 (truncated or "
                                     "corrupt)", sample_index) from None
    dtype = np.dtype(name).newbyteorder("<")
    if len(raw) % dtype.itemsize:
        raise RolloutValidationError(f"meta_info.{key} has {len(raw)} bytes, not a whole "
                                     f"number of {name}", sample_index)
    return np.frombuffer(raw, dtype=dtype)


def scoring_rows(prompt_len: int, num_response: int, logprob_start_len: int,
                 null_prefix: int, sample_index: int | None = None) -> np.ndarray:
    """Flat-array rows that score the response tokens of a scoring request.

    The scoring request sends input_ids = prompt + response. Covered input positions start at
    `logprob_start_len`; SGLang's first covered position always has no row (a null row at
    `logprob_start_len`: input logprobs are `[None] + ...`, logprob_result_processor.py:38/66/80
    (0.5.23)), counted by `null_prefix`. The row of input position q is the distribution of the
    token *at* q (computed from the logits of q - 1), so response token t (input position
    prompt_len + t) is scored by row prompt_len + t - logprob_start_len - null_prefix. The client
    asks for logprob_start_len = prompt_len - 1, which with null_prefix 1 makes it row t.

    Returns:
        [T] int64 row indices.

    Raises:
        RolloutValidationError: the request does not cover the first response token.
    """
    first_row = prompt_len - logprob_start_len - null_prefix
    if first_row < 0:
        raise RolloutValidationError(
            f"scoring response does not cover the first response token: prompt_len="
            f"{prompt_len}, logprob_start_len={logprob_start_len}, null_prefix={null_prefix} "
            "(request logprob_start_len = len(prompt) - 1)", sample_index, 0)
    return first_row + np.arange(num_response, dtype=np.int64)


def parse_scoring_response(body: bytes | str | dict | list, samples: list[RolloutSample],
                           top_logprobs: int, vocab_size: int | None = None, *,
                           logprob_start_lens: list[int] | None = None,
                           validate: bool = True,
                           sample_indices: list[int] | None = None) -> list[RolloutSample]:
    """Attaches the flat base64 top-K of a scoring request to already parsed samples.

    The scoring request (one item per sample) is: input_ids = prompt + response,
    `max_new_tokens=0`, `logprob_start_len=len(prompt) - 1`, `top_logprobs_num=K`,
    `return_flat_raw_top_logprobs(_b64)=true`. The sampled-token logprob stays the one from the
    generation (`behavior_logprob`); it is folded into the prefill top-K as usual. Prompt-side
    top-K is untempered in SGLang: only temperature 1 (or 0) gives one consistent distribution.

    Args:
        body: Scoring response (list for batched requests, in `samples` order).
        samples: Samples from the generation response; their `prompt_ids` must be set.
        top_logprobs: K (the flat shape's k must be >= K; extra columns are ignored).
        vocab_size: For validation.
        logprob_start_lens: Per-sample logprob_start_len used (default: each prompt length - 1).
        validate: Check the support contract (`megatron_pdm.ops.support`).
        sample_indices: Index of each sample in error messages (default: its list position).

    Returns:
        The same sample objects, with support_* replaced (shape [T, K+1]).
    """
    # decode and fold with the collector paused; the tree is released before it resumes
    with gc_paused():
        _attach_scoring(body, samples, top_logprobs, vocab_size, logprob_start_lens, validate,
                        sample_indices)
    return samples


def _attach_scoring(body, samples, top_logprobs, vocab_size, logprob_start_lens, validate,
                    sample_indices) -> None:
    obj = loads(body) if isinstance(body, (bytes, bytearray, memoryview, str)) else body
    objs = obj if isinstance(obj, list) else [obj]
    if len(objs) != len(samples):
        raise MalformedResponseError(f"scoring response has {len(objs)} items for "
                                     f"{len(samples)} samples")
    for pos, (o, sample) in enumerate(zip(objs, samples)):
        i = pos if sample_indices is None else int(sample_indices[pos])
        if not isinstance(o, dict) or not isinstance(o.get("meta_info"), dict):
            raise MalformedResponseError("not a /generate response object", i)
        vals_rk, idx_rk, null_prefix = decode_flat_topk(o["meta_info"], i)
        if idx_rk.shape[1] < top_logprobs:
            raise RolloutValidationError(f"flat top-K has k={idx_rk.shape[1]} < {top_logprobs}", i)
        p = int(sample.prompt_ids.shape[0])
        t = sample.num_tokens
        start = p - 1 if logprob_start_lens is None else int(logprob_start_lens[pos])
        rows_t = scoring_rows(p, t, start, null_prefix, i)
        if t and rows_t[-1] >= vals_rk.shape[0]:
            raise RolloutValidationError(
                f"flat top-K has {vals_rk.shape[0]} rows, response needs {rows_t[-1] + 1}", i,
                int(vals_rk.shape[0] - rows_t[0]))
        ids_tk = idx_rk[rows_t, :top_logprobs]
        lp_tk = vals_rk[rows_t, :top_logprobs]
        valid_tk = check_topk_values(lp_tk, np.ones(lp_tk.shape, dtype=bool), i)
        ids_tk, lp_tk, valid_tk = sort_rank_order(ids_tk, lp_tk, valid_tk)
        sampled_ids = sample.response_ids.numpy()
        sampled_lp = sample.behavior_logprob.numpy().astype(np.float64)
        ids_ts, lp_ts, valid_ts, n_in = folded_support(ids_tk, lp_tk, valid_tk, sampled_ids,
                                                       sampled_lp, vocab_size, i, validate)
        sample.support_ids = torch.from_numpy(ids_ts)
        sample.support_logprobs = torch.from_numpy(lp_ts)
        sample.support_valid = torch.from_numpy(valid_ts)
        sample.meta_info["sampled_in_topk"] = n_in
        sample.meta_info["topk_transport"] = "scoring_b64"
        sample.meta_info["num_neg_inf_slots"] = int((~valid_tk).sum())
