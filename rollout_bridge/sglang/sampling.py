"""Sampling params the SGLang client forwards, and what SGLang refuses before a request is sent.

`check_sglang_sampling_params` is the shared guard (`core.engine.check_sampling_params`: no
truncation, no logit modifiers) plus SGLang's own refusals with `--skip-tokenizer-init` or at all
(rollout_bridge/sglang/client.py docstring, "Sampling params"). `SAMPLING_KEYS` is checked against
the installed sglang's `SamplingParams` in CI (tests/rollout_bridge/sglang, marker sglang_api).
"""

from __future__ import annotations

from rollout_bridge.core.engine import LOGIT_MODIFIERS, check_sampling_params
from rollout_bridge.core.types import SamplingParamsError

SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "sampling_seed", "stop", "stop_regex", *LOGIT_MODIFIERS} - {"min_tokens",
                                                            "custom_logit_processor"})
"""`sampling_params` keys the client forwards (each is a field of sglang's SamplingParams in
0.5.22 and 0.5.23, checked in CI); everything else is refused before a request is sent."""

_SCORING_TEMPERATURES = (0.0, 1.0)


def check_sglang_sampling_params(params: dict, allow_truncated_sampling: bool = False,
                                 topk_transport: str = "json") -> float:
    """`check_sampling_params` plus SGLang's own refusals (module docstring). Returns T."""
    unknown = sorted(set(params) - SAMPLING_KEYS - {"n"})
    if unknown:
        raise SamplingParamsError(f"sampling params {unknown} are not forwarded to SGLang "
                                  f"(known: {sorted(SAMPLING_KEYS)})")
    if params.get("top_k") is not None and int(params["top_k"]) == 0:
        raise SamplingParamsError("top_k=0: SGLang refuses it (HTTP 400, 'top_k must be -1 "
                                  "(disable) or at least 1'); use top_k=-1 for no truncation")
    for key in ("stop", "stop_regex"):
        if params.get(key):
            raise SamplingParamsError(f"{key}={params[key]!r}: string stops need the server's "
                                      "tokenizer (--skip-tokenizer-init refuses them); use "
                                      "stop_token_ids")
    temperature = check_sampling_params(params, allow_truncated_sampling)
    if topk_transport == "scoring_b64" and temperature not in _SCORING_TEMPERATURES:
        raise SamplingParamsError(
            f"topk_transport='scoring_b64' at temperature {temperature}: SGLang's prompt-side "
            "top-K is log_softmax of the raw logits (untempered) while the sampled logprob is "
            "tempered, so the support would mix two distributions; use 'flat_b64' or 'json'")
    return temperature
