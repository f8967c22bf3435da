"""SGLang's /generate response format, rebuilt from arrays (for the fake server).

Each function follows one piece of sglang 0.5.22/0.5.23's own formatting code (paths relative to
the `sglang` package; line numbers of 0.5.23):
  * `meta_info` / `response_object`: `TokenizerManager._handle_batch_output` with
    `--skip-tokenizer-init` (srt/managers/tokenizer_manager.py:2480-2720): key order
    id, finish_reason, prompt_tokens, weight_version, num_retractions, the logprob fields,
    reasoning_tokens, completion_tokens, cached_tokens; the object is {"output_ids", "meta_info"}
    (no "text"); e2e_latency / response_sent_to_client_ts are added by the HTTP layer.
  * logprob fields: `add_logprob_to_meta_info` (:2840): `[logprob, id, null]` triples, top-K rows
    nested (a position without a row is null) unless a flat flag is set; flat fields only on a
    finished response; a non-rectangular output side falls back to nested.
  * flat arrays: `build_flat_top_logprobs_arrays` / `flat_top_logprobs_layout`
    (srt/managers/io_struct.py:1582-1627): leading empty rows counted into null_prefix, float32 /
    int32 little-endian for base64, plain JSON lists otherwise.
  * prompt rows: the scheduler puts one null row at `logprob_start_len`
    (srt/managers/scheduler_components/logprob_result_processor.py:38/66/80).

tests/rollout_bridge/sglang/test_sglang_formatting.py feeds the same arrays to the installed
sglang's real TokenizerManager + HTTP handler and requires identical bodies (both supported
versions).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pybase64

VOLATILE_META_KEYS = ("e2e_latency", "response_sent_to_client_ts")


def triples(vals, ids) -> list[list]:
    """`detokenize_logprob_tokens` without text: [[logprob|None, id, None], ...]."""
    return [[None if v is None else float(v), int(i), None] for v, i in zip(vals, ids)]


def top_rows(vals_rows, idx_rows) -> list:
    """`detokenize_top_logprobs_tokens`: a row per position, None where the position has none."""
    return [triples(v, i) if v else None for v, i in zip(vals_rows, idx_rows)]


def flat_layout(vals_rows, k: int) -> tuple[int, int]:
    """`flat_top_logprobs_layout`: (null_prefix, k); ValueError for interior nulls or ragged k."""
    null_prefix = 0
    while null_prefix < len(vals_rows) and not vals_rows[null_prefix]:
        null_prefix += 1
    rows = vals_rows[null_prefix:]
    k = len(rows[0]) if rows else k
    for off, row in enumerate(rows):
        if row is None or len(row) != k:
            raise ValueError(f"row {null_prefix + off} is not rectangular")
    return null_prefix, k


def flat_fields(side: str, vals_rows, idx_rows, k: int, b64: bool) -> dict:
    """`_build_flat_top_logprobs_fields(side, ...)`."""
    null_prefix, k = flat_layout(vals_rows, k)
    rows_v, rows_i = vals_rows[null_prefix:], idx_rows[null_prefix:]
    if b64:
        val = np.asarray(rows_v, dtype=np.float32).reshape(len(rows_v), k)
        idx = np.asarray(rows_i, dtype=np.int32).reshape(len(rows_i), k)
        return {
            f"{side}_top_logprobs_val_flat_b64": pybase64.b64encode(
                val.astype("<f4").tobytes()).decode("utf-8"),
            f"{side}_top_logprobs_idx_flat_b64": pybase64.b64encode(
                idx.astype("<i4").tobytes()).decode("utf-8"),
            f"{side}_top_logprobs_val_flat_b64_dtype": "float32",
            f"{side}_top_logprobs_idx_flat_b64_dtype": "int32",
            f"{side}_top_logprobs_shape": [len(rows_v), k],
            f"{side}_top_logprobs_null_prefix": null_prefix,
        }
    return {f"{side}_top_logprobs_val_flat": [float(v) for r in rows_v for v in r],
            f"{side}_top_logprobs_idx_flat": [int(i) for r in rows_i for i in r],
            f"{side}_top_logprobs_shape": [len(rows_v), k],
            f"{side}_top_logprobs_null_prefix": null_prefix}


def prompt_rows(input_ids: list[int], start: int, row_vals, row_ids, top_v, top_i):
    """Prompt-side arrays as the scheduler sends them: positions start..L-1, a null row first.

    `row_vals[q]` / `top_v[q]` are the logprob / top-K of the token at position q (q >= start+1).
    Returns (token_vals, token_ids, top_vals_rows, top_idx_rows).
    """
    positions = range(start + 1, len(input_ids))
    tok_v = [None] + [row_vals[q] for q in positions]
    tok_i = [int(input_ids[start])] + [int(input_ids[q]) for q in positions]
    tv = [None] + [list(top_v[q]) for q in positions] if top_v is not None else []
    ti = [None] + [list(top_i[q]) for q in positions] if top_i is not None else []
    return tok_v, tok_i, tv, ti


def meta_info(*, rid: str, finish_reason: dict | None, prompt_tokens: int,
              weight_version: str, request: dict, out_lp=(), out_ids=(), out_top_v=(),
              out_top_i=(), in_lp=(), in_ids=(), in_top_v=(), in_top_i=(),
              completion_tokens: int = 0, cached_tokens: int = 0, reasoning_tokens: int = 0,
              num_retractions: int = 0) -> dict:
    """meta_info of one response item (`_handle_batch_output` + `add_logprob_to_meta_info`)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish_reason,
                            "prompt_tokens": int(prompt_tokens),
                            "weight_version": weight_version, "num_retractions": num_retractions}
    if request.get("return_logprob"):
        k = int(request.get("top_logprobs_num") or 0)
        finished = finish_reason is not None
        meta["input_token_logprobs"] = triples(in_lp, in_ids)
        meta["output_token_logprobs"] = triples(out_lp, out_ids)
        meta["output_token_logprobs_length"] = len(out_ids)
        if k > 0:
            b64 = bool(request.get("return_flat_raw_top_logprobs_b64"))
            use_flat = bool(request.get("return_flat_raw_top_logprobs"))
            if use_flat:
                try:
                    meta.update(flat_fields("input", list(in_top_v), list(in_top_i), k, b64))
                except ValueError:
                    use_flat = False
            if not use_flat:
                meta["input_top_logprobs"] = top_rows(in_top_v, in_top_i)
            use_flat_out = bool(request.get("return_flat_raw_output_top_logprobs"))
            if use_flat_out and finished:
                try:
                    meta.update(flat_fields("output", list(out_top_v), list(out_top_i), k, b64))
                except ValueError:
                    use_flat_out = False
            if not (use_flat_out and finished):
                meta["output_top_logprobs"] = top_rows(out_top_v, out_top_i)
    meta.update({"reasoning_tokens": reasoning_tokens, "completion_tokens": completion_tokens,
                 "cached_tokens": cached_tokens})
    return meta


def response_object(output_ids: list[int], meta: dict, *, e2e_latency: float = 0.0,
                    sent_ts: float = 0.0) -> dict:
    """One response item with `--skip-tokenizer-init` (no "text")."""
    meta = dict(meta, e2e_latency=e2e_latency, response_sent_to_client_ts=sent_ts)
    return {"output_ids": [int(x) for x in output_ids], "meta_info": meta}


def finish_length(n: int) -> dict:
    return {"type": "length", "length": int(n)}


def finish_stop(token: int) -> dict:
    return {"type": "stop", "matched": int(token)}


def finish_abort(message: str = "Abort before prefill") -> dict:
    return {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequest"}


def strip_volatile(obj):
    """The body without timing fields (for comparisons)."""
    if isinstance(obj, list):
        return [strip_volatile(o) for o in obj]
    if isinstance(obj, dict) and isinstance(obj.get("meta_info"), dict):
        meta = {k: v for k, v in obj["meta_info"].items() if k not in VOLATILE_META_KEYS}
        return dict(obj, meta_info=meta)
    return obj
