"""The trust-region family as verl 0.9.1 policy losses, fed by verl's megatron logits hook.

Importing this module registers one verl policy loss per token-level preset of
`megatron_pdm.config.PRESETS` ("pdm-agg", "grpo", "dppo-topk-kl", ..., `REGISTERED`) in verl's
own registry (`verl/trainer/ppo/core_algos.py`: `register_policy_loss`, looked up by
`get_policy_loss_fn(config.policy_loss.loss_mode)` in `verl/workers/utils/losses.py: ppo_loss`).
Nothing is registered before the import; without verl 0.9.x the import raises ImportError
naming the version and the `megatron-pdm[verl]` extra.

How the pieces meet verl's code (facts from the verl 0.9.1 wheel):

* `verl/workers/engine/megatron/transformer_impl.py: _lm_head_logits_processor` divides the
  vocab-parallel logits shard by the temperature in place, then, when the micro-batch's
  non-tensor flag `distillation_use_topk` is true, calls the actor's loss function as
  `loss_fn(student_logits=logits, data=batch, data_format=...)` and merges the returned dict of
  per-row tensors (shape `logits.shape[:2]`) into the model output beside its own `log_probs`.
  `pdm_ppo_loss` is such a loss function (the same two roles as verl's own
  `verl/trainer/distillation/losses.py: distillation_ppo_loss`): called with `student_logits`
  it packs the batch's `pdm_topk_ids` / `pdm_topk_logprobs` (nested [bsz, prompt + response,
  S], token-aligned like `input_ids`) and the labels with verl's `preprocess_thd_engine` /
  `preprocess_bshd_engine(need_roll=True)` (row p scores token p + 1, as verl packs its label)
  and returns `verl_rows.pdm_token_fields`: the detached weights for A > 0 and A < 0.
* Called with `model_output`, it slices those fields to the response like verl's log_probs
  (`verl/workers/utils/padding.py: no_padding_2_padding`), picks w(sign A) per token, puts it
  in the micro-batch as `rollout_is_weights` (verl's per-token multiplier of the policy loss)
  and calls verl's own `ppo_loss`, so verl's entropy and KL terms, global-batch normalisation
  and metrics stay verl's. The registered loss then computes, per token only,
  `-A * w * log_prob` and aggregates it with verl's `agg_loss(loss_agg_mode,
  **config.global_batch_info)`. With loss_agg_mode "token-mean" that is the project's
  `policy_loss` (tests/integrations/test_verl_adapter.py checks it through verl's registry).

The wiring (docs/own-loop.md, "verl"): `actor_rollout_ref.actor.policy_loss.loss_mode=pdm-agg`,
the actor worker's `set_loss_fn(partial(pdm_ppo_loss, config=actor_config, vocab_size=V))`
(`verl/workers/engine_workers.py: set_loss_fn`), `distillation_use_topk=True` on the update
batch, and the rollout returning top-K (`verl_rows.support_from_vllm_logprobs`), e.g. under the
keys `teacher_ids` / `teacher_logprobs` that verl's agent loop already carries into the batch
(`support_keys`).

Limits: megatron engine without fused kernels (the fused path materialises no logits); the
weight is taken against the support's behaviour logprob, so do not also enable verl's rollout
correction (a `rollout_is_weights` already in the batch is refused); sequence-level
corrections and aggregations of the project's config are not per-token and are refused.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from megatron_pdm.config import PRESETS, PolicyLossConfig
from megatron_pdm.integrations import verl_rows

SUPPORTED = "0.9."


def _require_verl() -> None:
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or not version.startswith(SUPPORTED):
        raise ImportError(
            f"megatron_pdm.integrations.verl needs verl {SUPPORTED}x (found "
            f"{version or 'none'}): pip install 'megatron-pdm[verl]' (or scripts/verl_env.sh "
            "for the CPU check environment)")


_require_verl()

from verl.trainer.ppo import core_algos  # noqa: E402  (after the version check)
from verl.utils import torch_functional as verl_F  # noqa: E402

__all__ = ["REGISTERED", "SUPPORT_KEYS", "pdm_ppo_loss", "preset_for", "verl_policy_loss"]


def _token_level(name: str) -> bool:
    cfg = PolicyLossConfig.preset(name)
    return not (cfg.uses_sequences or cfg.seq_mask_kl is not None)


REGISTERED = tuple(sorted(n for n in PRESETS if _token_level(n)))


def preset_for(config: Any) -> PolicyLossConfig:
    """The preset named by verl's `config.policy_loss.loss_mode` (ActorConfig or DictConfig)."""
    policy = getattr(config, "policy_loss", None)
    mode = policy.get("loss_mode", None) if policy is not None else None
    if mode not in REGISTERED:
        raise ValueError(f"config.policy_loss.loss_mode={mode!r}: not a megatron-pdm loss; set "
                         f"it to one of {list(REGISTERED)}")
    return PolicyLossConfig.preset(mode)


def verl_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                     advantages: torch.Tensor, response_mask: torch.Tensor,
                     loss_agg_mode: str = "token-mean", config: Any = None,
                     rollout_is_weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's PolicyLossFn: -A * w * log_prob per token, aggregated by verl's agg_loss.

    `rollout_is_weights` is the family's detached weight w(sign A) (`pdm_ppo_loss` puts it
    there); every tensor is [bsz, response_length].
    """
    if rollout_is_weights is None:
        raise ValueError(
            "rollout_is_weights is None: the megatron-pdm losses need the trust-region weight "
            "from the logits processor; use megatron_pdm.integrations.verl.pdm_ppo_loss as the "
            "actor's loss function (set_loss_fn) and distillation_use_topk=True on the batch")
    shape = tuple(log_prob.shape)
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages),
                    ("response_mask", response_mask), ("rollout_is_weights", rollout_is_weights)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from log_prob {shape}")
    mask = response_mask.to(torch.bool)
    coeff = (advantages * rollout_is_weights).detach().to(log_prob.dtype)
    # coeff = 0 rows add exactly 0 (a -inf log_prob there gives no NaN), as policy_loss does
    pg_losses = torch.where(mask & (coeff != 0), -coeff * log_prob, 0.0)
    batch_info = dict(getattr(config, "global_batch_info", None) or {})
    pg_loss = core_algos.agg_loss(loss_mat=pg_losses, loss_mask=mask, loss_agg_mode=loss_agg_mode,
                                  **batch_info)
    moving = mask & (advantages != 0)
    masked = (rollout_is_weights == 0).float()
    metrics = {
        "actor/pg_clipfrac": verl_F.masked_mean(masked, moving).detach().item(),
        "actor/ppo_kl": verl_F.masked_mean(old_log_prob - log_prob.detach(), mask).detach().item(),
        "actor/pdm_weight_mean": verl_F.masked_mean(rollout_is_weights.float(), mask).item(),
    }
    return pg_loss, metrics


def _register() -> None:
    for name in REGISTERED:
        existing = core_algos.POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not verl_policy_loss:
            raise RuntimeError(f"verl already has a policy loss named {name!r} "
                               f"({existing.__module__}.{existing.__name__})")
        core_algos.register_policy_loss(name)(verl_policy_loss)


_register()


def _tp_group_default():
    from megatron_pdm.mcore.loss_adapter import _tp_group
    return _tp_group()


SUPPORT_KEYS = ("pdm_topk_ids", "pdm_topk_logprobs")


def _processor(config: Any, data: Any, student_logits: torch.Tensor, data_format: str, *,
               vocab_size: int | None, tp_group: Any, support_keys: tuple[str, str]
               ) -> dict[str, torch.Tensor]:
    """The logits-processor role: verl's nested batch keys packed like its label, the fields."""
    for key in (*support_keys, "input_ids"):
        if key not in data.keys():
            raise KeyError(f"batch key {key!r} is missing: the rollout must put the top-K "
                           "support in the batch (docs/own-loop.md, 'verl')")
    from verl.models.mcore import util as mcore_util  # needs megatron-core, as verl's engine
    pack = (mcore_util.preprocess_thd_engine if data_format == "thd"
            else mcore_util.preprocess_bshd_engine)
    ids, lp, label = (pack(data[k], pre_process=True, need_roll=True)[0]
                      for k in (*support_keys, "input_ids"))
    group = _tp_group_default() if tp_group == "parallel_state" else tp_group
    return verl_rows.pdm_token_fields(student_logits, label, ids, lp, preset_for(config),
                                      tp_group=group, vocab_size=vocab_size)


def _as_data_layout(w_BR: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A padded [bsz, R] tensor in the layout of the batch's `response_mask` (nested or not)."""
    if not like.is_nested:
        return w_BR
    lens = like.offsets().diff().tolist()
    return torch.nested.as_nested_tensor([w_BR[b, :n] for b, n in enumerate(lens)],
                                         layout=torch.jagged)


def pdm_ppo_loss(config: Any, model_output: dict | None = None, data: Any = None,
                 dp_group: Any = None, student_logits: torch.Tensor | None = None,
                 data_format: str = "thd", *, vocab_size: int | None,
                 tp_group: Any = "parallel_state", support_keys: tuple[str, str] = SUPPORT_KEYS):
    """The actor loss function for verl's megatron engine (logits processor and final loss).

    With `student_logits` (verl's logits hook): returns {pdm_weight_pos, pdm_weight_neg,
    pdm_divergence, pdm_has_support}, each of shape `student_logits.shape[:2]`.
    Else: verl's `ppo_loss` with `rollout_is_weights` = w(sign A) (see the module docstring).
    `vocab_size`: the engine's vocabulary (megatron pads its own); `tp_group`: the tensor-
    parallel group ("parallel_state": megatron's); `support_keys`: the batch keys of the support
    ids and logprobs (nested [bsz, prompt + response, S]); ("teacher_ids", "teacher_logprobs")
    uses the path verl already has for those keys (docs/own-loop.md, "verl").
    """
    if student_logits is not None:
        return _processor(config, data, student_logits, data_format, vocab_size=vocab_size,
                          tp_group=tp_group, support_keys=tuple(support_keys))
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    preset_for(config)  # a clear error before verl's lookup
    missing = [k for k in verl_rows.FIELD_KEYS if k not in model_output]
    if missing:
        raise KeyError(f"model_output lacks {missing}: the logits processor did not run "
                       "(set the non-tensor batch flag distillation_use_topk=True)")
    if "rollout_is_weights" in data.keys():
        raise ValueError("the batch already has rollout_is_weights (verl's rollout correction): "
                         "the megatron-pdm weight includes the importance weight min(r, C); "
                         "turn verl's rollout correction off")
    f = {k: no_padding_2_padding(model_output[k], data) for k in verl_rows.FIELD_KEYS}
    resp_mask = data["response_mask"]
    mask_BR = (resp_mask.to_padded_tensor(0) if resp_mask.is_nested else resp_mask).bool()
    adv = data["advantages"]
    adv_BR = adv.to_padded_tensor(0.0) if adv.is_nested else adv
    lacking = mask_BR & (f["pdm_has_support"] == 0)
    if bool(lacking.any()):
        b, t = (int(i) for i in lacking.nonzero()[0])
        raise ValueError(f"pdm_topk_ids / pdm_topk_logprobs: sample {b}, response token {t} has "
                         "no support slot holding the sampled token (fold it in: "
                         "verl_rows.support_from_vllm_logprobs)")
    w_BR = verl_rows.select_weight(adv_BR, f["pdm_weight_pos"], f["pdm_weight_neg"])
    data = data.copy()  # shallow: the caller's batch keeps its keys
    data["rollout_is_weights"] = _as_data_layout(w_BR, resp_mask)
    return ppo_loss(config, model_output, data, dp_group)
