"""slime's rollout hooks that bring the engine's top-K to `pdm_loss` (docs/own-loop.md, "slime").

* `generate` (`--custom-generate-function-path megatron_pdm.integrations.slime.generate`):
  slime's default SGLang request (slime/rollout/sglang_rollout.py: `generate`, at the slime
  commit named in passthrough.patch) plus `top_logprobs_num = args.pdm_top_k`. The answer is
  checked by the project's SGLang parser (`rollout_bridge.sglang.parse.parse_response_object`:
  lengths, sampled ids, top-K ids in [0, pdm_vocab_size), duplicates, NaN, sum of mu); slime's
  own fields are then filled as its default does (`Sample.append_response_tokens` with the
  sampled ids and logprobs of `output_token_logprobs` and the `meta_info`), and the top-K goes
  beside them as two sample attributes: `pdm_topk_ids_RK` int32 [R, K] and
  `pdm_topk_logprobs_RK` fp32 [R, K] (rank order; -inf marks an unused slot). slime's
  `Sample.to_dict` / `from_dict` keep such attributes, so partial rollouts carry them; a later
  turn appends rows.
* `convert_samples` (`--custom-convert-samples-to-train-data-path
  megatron_pdm.integrations.slime.convert_samples`): slime's own conversion (the method
  `RolloutManager._convert_samples_to_train_data` of slime/ray/rollout.py, rewards
  post-processing included) plus `pdm_topk_ids` / `pdm_topk_logprobs`, one [R_b, K] tensor per
  sample in sample order: the layout `pdm_loss` reads.

Args read: `pdm_top_k` (K >= 1, required), `pdm_vocab_size` (the engine's vocabulary; None: only
ids >= 0 are checked) and slime's own (`sglang_router_ip`, `sglang_router_port`,
`use_rollout_routing_replay`, `router_policy`). Not supported: multimodal samples (slime's
default sends their text and images; this hook sends token ids only) and response tokens added
by anything other than this hook (a tool's tokens have no engine top-K): both raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from rollout_bridge.core.types import RolloutValidationError
from rollout_bridge.sglang.parse import parse_response_object

__all__ = ["convert_samples", "generate", "record_response", "topk_train_data"]

IDS, LPS = "pdm_topk_ids_RK", "pdm_topk_logprobs_RK"   # the sample attributes
TRAIN_KEYS = ("pdm_topk_ids", "pdm_topk_logprobs")      # the train-data keys (pdm_loss)


class Transport(Protocol):
    """What `generate` needs from slime: the prompt's ids and one POST to the router."""

    def prompt_ids(self, sample: Any) -> list[int]: ...

    async def post(self, payload: dict, headers: dict | None) -> dict: ...


def top_k(args: Any) -> int:
    k = getattr(args, "pdm_top_k", None)
    if k is None or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"args.pdm_top_k = {k!r}: the number of engine top-K logprobs per "
                         "token (an int >= 1) must be set for the PDM hooks")
    return k


def _name(sample: Any) -> str:
    return f"slime sample index={sample.index} group={sample.group_index}"


def _stored(sample: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return getattr(sample, IDS, None), getattr(sample, LPS, None)


def record_response(args: Any, sample: Any, output: dict) -> None:
    """Checks one SGLang `/generate` answer and appends it to `sample` (module docstring)."""
    k = top_k(args)
    prev = int(sample.response_length)
    ids_old, lp_old = _stored(sample)
    have = 0 if ids_old is None else int(ids_old.shape[0])
    if have != prev:
        raise ValueError(f"{_name(sample)}: {prev} response tokens but top-K rows for {have}; "
                         "tokens this hook did not generate (a tool's, another generate "
                         "function's) have no engine top-K")
    try:
        parsed = parse_response_object(output, k, getattr(args, "pdm_vocab_size", None), 0)
    except RolloutValidationError as err:
        reason = str(err)
        if err.sample_index is not None or err.position is not None:
            reason = reason.split(": ", 1)[1]
        at = "" if err.position is None else f", response position {prev + err.position}"
        raise RolloutValidationError(f"{_name(sample)}{at}: {reason}") from None
    valid_RK = parsed.support_valid[:, :k]
    ids_RK = torch.where(valid_RK, parsed.support_ids[:, :k], 0).to(torch.int32)
    lp_RK = torch.where(valid_RK, parsed.support_logprobs[:, :k], -torch.inf).float()
    otl = output["meta_info"]["output_token_logprobs"]   # checked by the parser
    sample.append_response_tokens(args, tokens=[item[1] for item in otl],
                                  log_probs=[item[0] for item in otl], trainable=True,
                                  meta_info=output["meta_info"], text=output.get("text", ""))
    setattr(sample, IDS, ids_RK if ids_old is None else torch.cat([ids_old, ids_RK]))
    setattr(sample, LPS, lp_RK if lp_old is None else torch.cat([lp_old, lp_RK]))


class _SlimeTransport:
    """slime's own prompt preparation and HTTP post (slime/rollout/sglang_rollout.py)."""

    def __init__(self, args: Any):
        from slime.rollout.sglang_rollout import GenerateState, _prepare_prompt_ids
        from slime.utils.http_utils import post

        self._state, self._prepare, self._post = GenerateState(args), _prepare_prompt_ids, post
        self._url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"

    def prompt_ids(self, sample: Any) -> list[int]:
        return self._prepare(sample, self._state.tokenizer, self._state.processor)

    async def post(self, payload: dict, headers: dict | None) -> dict:
        return await self._post(self._url, payload, headers=headers)


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], *,
                   transport: Transport | None = None) -> Any:
    """slime's custom generate: its default request with the top-K asked for (module doc)."""
    k = top_k(args)
    status = sample.Status
    if sample.status not in (status.PENDING, status.ABORTED):
        raise ValueError(f"{_name(sample)}: status {sample.status}, expected PENDING or ABORTED")
    if sample.multimodal_inputs and any(v is not None for v in sample.multimodal_inputs.values()):
        raise ValueError(f"{_name(sample)}: multimodal inputs are not supported by the PDM "
                         "generate hook (it sends token ids only)")
    t = transport if transport is not None else _SlimeTransport(args)
    prompt_ids = t.prompt_ids(sample)
    params = dict(sampling_params)
    params["max_new_tokens"] = int(params["max_new_tokens"]) - int(sample.response_length)
    if params["max_new_tokens"] < 0:
        raise ValueError(f"{_name(sample)}: response_length {sample.response_length} exceeds "
                         f"max_new_tokens {sampling_params['max_new_tokens']}")
    if params["max_new_tokens"] == 0:
        sample.status = status.TRUNCATED
        return sample
    payload = {"input_ids": list(prompt_ids), "sampling_params": params, "return_logprob": True,
               "top_logprobs_num": k}
    if getattr(args, "use_rollout_routing_replay", False):
        payload["return_routed_experts"] = True
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    headers = None
    if sample.session_id and getattr(args, "router_policy", None) == "consistent_hashing":
        headers = {"X-SMG-Routing-Key": sample.session_id}
    record_response(args, sample, await t.post(payload, headers))
    return sample


def _flat(samples: list) -> list:
    while samples and isinstance(samples[0], list):
        samples = [s for group in samples for s in group]
    return samples


def topk_train_data(args: Any, samples: list) -> dict[str, list[torch.Tensor]]:
    """`pdm_topk_ids` / `pdm_topk_logprobs`: one [R_b, K] tensor per sample, in sample order."""
    k = top_k(args)
    out: dict[str, list[torch.Tensor]] = {key: [] for key in TRAIN_KEYS}
    for b, sample in enumerate(_flat(samples)):
        ids_RK, lp_RK = _stored(sample)
        if ids_RK is None or lp_RK is None:
            raise ValueError(f"samples[{b}] ({_name(sample)}) has no top-K: generate it with "
                             "--custom-generate-function-path megatron_pdm.integrations.slime."
                             "generate")
        r = int(sample.response_length)
        for name, x in ((IDS, ids_RK), (LPS, lp_RK)):
            if tuple(x.shape) != (r, k):
                raise ValueError(f"samples[{b}] ({_name(sample)}): {name} has shape "
                                 f"{tuple(x.shape)}, expected [R={r}, K={k}]")
        out["pdm_topk_ids"].append(ids_RK.to(torch.int32))
        out["pdm_topk_logprobs"].append(lp_RK.float())
    return out


def _slime_default(args: Any, samples: list) -> dict:
    """slime's own conversion, called on a stand-in for its RolloutManager (the method reads
    `args`, the reward post-process function and `_post_process_rewards` only)."""
    import types

    from slime.ray.rollout import RolloutManager
    from slime.utils.misc import load_function

    meta = getattr(RolloutManager, "__ray_metadata__", None)   # @ray.remote wraps the class
    cls = RolloutManager if meta is None else \
        getattr(meta.modified_class, "__ray_actor_class__", meta.modified_class)
    path = getattr(args, "custom_reward_post_process_path", None)
    shim = types.SimpleNamespace(args=args, custom_convert_samples_to_train_data_func=None,
                                 custom_reward_post_process_func=load_function(path) if path
                                 else None)
    shim._post_process_rewards = types.MethodType(cls._post_process_rewards, shim)
    return cls._convert_samples_to_train_data(shim, samples)


def convert_samples(args: Any, samples: list, *,
                    default: Callable[[Any, list], dict] | None = None) -> dict:
    """slime's convert hook: its usual train data plus the top-K keys (module docstring)."""
    flat = _flat(samples)
    data = (default or _slime_default)(args, flat)
    clash = sorted(set(TRAIN_KEYS) & set(data))
    if clash:
        raise ValueError(f"slime's train data already has {clash}")
    data.update(topk_train_data(args, flat))
    return data
