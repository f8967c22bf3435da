"""rollout_bridge: rollouts with behavior-policy top-K support, from SGLang or in-process.

Public API (README, "Rollout bridge")::

    from rollout_bridge import SGLangEngine, LocalEngine, parse_generate_response
    samples = parse_generate_response(body, top_k=20, vocab_size=None)
    engine = SGLangEngine("http://127.0.0.1:30000", top_k=20, timeout_s=60, max_retries=3)
    batch = engine.generate(prompt_ids, {"temperature": 1.0, "max_new_tokens": 256}, n=8)
    packed = pack_thd(batch, advantages=group_advantages(batch))

Never imports megatron or megatron_pdm (tests/unit/test_import_boundaries.py).
"""

from rollout_bridge import types as errors
from rollout_bridge.engine import RolloutEngine, check_sampling_params
from rollout_bridge.local_engine import LocalEngine
from rollout_bridge.packing import pack_padded, pack_thd
from rollout_bridge.parse import (
    MalformedResponseError,
    fold_support,
    parse_generate_response,
    parse_scoring_response,
    validate_support,
)
from rollout_bridge.sglang_client import SGLangEngine
from rollout_bridge.types import (
    EngineMismatchError,
    PackedBatch,
    RolloutBatch,
    RolloutFailedError,
    RolloutFailure,
    RolloutSample,
    RolloutValidationError,
    SamplingParamsError,
    StaleRolloutError,
    WeightSyncError,
    check_weight_version,
    group_advantages,
)

__all__ = [
    "EngineMismatchError", "LocalEngine", "MalformedResponseError", "PackedBatch",
    "RolloutBatch", "RolloutEngine", "RolloutFailedError", "RolloutFailure", "RolloutSample",
    "RolloutValidationError", "SGLangEngine", "SamplingParamsError", "StaleRolloutError",
    "WeightSyncError", "check_sampling_params", "check_weight_version", "errors",
    "fold_support", "group_advantages", "pack_padded", "pack_thd", "parse_generate_response",
    "parse_scoring_response", "validate_support",
]
