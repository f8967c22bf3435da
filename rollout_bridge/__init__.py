"""rollout_bridge: rollouts with behaviour-policy top-K support, from SGLang, vLLM or in-process.

Public API (docs/rollouts.md)::

    from rollout_bridge import SGLangEngine, LocalEngine, parse_generate_response
    samples = parse_generate_response(body, top_logprobs=20, vocab_size=None)
    engine = SGLangEngine("http://127.0.0.1:30000", top_logprobs=20, vocab_size=151936)
    engine = VLLMEngine("http://127.0.0.1:8000", top_logprobs=20, api_key=key)  # or vLLM
    batch = engine.generate(prompt_ids, {"temperature": 1.0, "max_new_tokens": 256}, n=8)
    packed = pack_thd(batch, advantages=group_advantages(batch))

Names resolve lazily (PEP 562), so `import rollout_bridge.types` does not load the HTTP client.
The bridge depends on `megatron_pdm.ops.support` (the support contract) and nothing else of
megatron_pdm; never on megatron (tests/unit/test_import_boundaries.py).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RolloutEngine": "rollout_bridge.engine",
    "check_sampling_params": "rollout_bridge.engine",
    "LocalEngine": "rollout_bridge.local_engine",
    "pack_padded": "rollout_bridge.packing",
    "pack_thd": "rollout_bridge.packing",
    "MalformedResponseError": "rollout_bridge.decode",
    "parse_generate_response": "rollout_bridge.parse",
    "parse_scoring_response": "rollout_bridge.parse_flat",
    "SGLangEngine": "rollout_bridge.sglang_client",
    "ApiKey": "rollout_bridge.sglang_http",
    "read_api_key": "rollout_bridge.sglang_http",
    "SGLangServerError": "rollout_bridge.sglang_http",
    "DistributedWeightSender": "rollout_bridge.sglang_weights",
    "VLLMEngine": "rollout_bridge.vllm_client",
    "parse_completion_choice": "rollout_bridge.parse_vllm",
    "EngineMismatchError": "rollout_bridge.types",
    "PackedBatch": "rollout_bridge.types",
    "RolloutBatch": "rollout_bridge.types",
    "RolloutFailedError": "rollout_bridge.types",
    "RolloutFailure": "rollout_bridge.types",
    "RolloutSample": "rollout_bridge.types",
    "RolloutValidationError": "rollout_bridge.types",
    "SamplingParamsError": "rollout_bridge.types",
    "StaleRolloutError": "rollout_bridge.types",
    "WeightSyncError": "rollout_bridge.types",
    "check_weight_version": "rollout_bridge.types",
    "group_advantages": "rollout_bridge.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
