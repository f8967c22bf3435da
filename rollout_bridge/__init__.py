"""rollout_bridge: rollouts with behaviour-policy top-K support, from SGLang, vLLM or in-process.

Public API (docs/rollouts.md)::

    from rollout_bridge import SGLangEngine, LocalEngine, parse_generate_response
    samples = parse_generate_response(body, top_logprobs=20, vocab_size=None)
    engine = SGLangEngine("http://127.0.0.1:30000", top_logprobs=20, vocab_size=151936)
    engine = VLLMEngine("http://127.0.0.1:8000", top_logprobs=20, api_key=key)  # or vLLM
    batch = engine.generate(prompt_ids, {"temperature": 1.0, "max_new_tokens": 256}, n=8)
    packed = pack_thd(batch, advantages=group_advantages(batch))

Names resolve lazily (PEP 562), so `import rollout_bridge.core.types` does not load the HTTP client.
The bridge depends on `megatron_pdm.ops.support` (the support contract) and nothing else of
megatron_pdm; never on megatron (tests/repo/test_import_boundaries.py).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RolloutEngine": "rollout_bridge.core.engine",
    "check_sampling_params": "rollout_bridge.core.engine",
    "LocalEngine": "rollout_bridge.local.engine",
    "pack_padded": "rollout_bridge.core.packing",
    "pack_thd": "rollout_bridge.core.packing",
    "MalformedResponseError": "rollout_bridge.core.decode",
    "parse_generate_response": "rollout_bridge.sglang.parse",
    "parse_scoring_response": "rollout_bridge.sglang.parse_flat",
    "SGLangEngine": "rollout_bridge.sglang.client",
    "ApiKey": "rollout_bridge.core.apikey",
    "read_api_key": "rollout_bridge.core.apikey",
    "SGLangServerError": "rollout_bridge.sglang.http",
    "DistributedWeightSender": "rollout_bridge.sglang.broadcast",
    "VLLMEngine": "rollout_bridge.vllm.client",
    "parse_completion_choice": "rollout_bridge.vllm.parse",
    "EngineMismatchError": "rollout_bridge.core.types",
    "PackedBatch": "rollout_bridge.core.types",
    "RolloutBatch": "rollout_bridge.core.types",
    "RolloutFailedError": "rollout_bridge.core.types",
    "RolloutFailure": "rollout_bridge.core.types",
    "RolloutSample": "rollout_bridge.core.types",
    "RolloutValidationError": "rollout_bridge.core.types",
    "SamplingParamsError": "rollout_bridge.core.types",
    "StaleRolloutError": "rollout_bridge.core.types",
    "WeightSyncError": "rollout_bridge.core.types",
    "check_weight_version": "rollout_bridge.core.types",
    "group_advantages": "rollout_bridge.core.types",
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
