"""slime's custom loss (`--loss-type custom_loss --custom-loss-function-path
megatron_pdm.integrations.slime.pdm_loss`): the family's loss on slime's packed logits.

Scope (tested in tests/integrations/test_slime_adapter.py and tests/integrations/test_slime_hooks.py
on slime-shaped inputs, not against an installed slime): context parallelism 1. The top-K keys come
from the hooks of `hooks.py` (generate, convert_samples) and reach this loss only through slime with
`passthrough.patch` applied (docs/own-loop.md, "slime").

slime calls `loss_fn(args, batch, logits, sum_of_sample_mean) -> (loss, log)` with `logits`
the packed THD output `[1, T, V_local]` (raw, before the rollout temperature) and per-sample
lists in `batch`. Sample b's response logits are rows [end_b - R_b - 1, end_b - 1) with end_b the
running sum of `total_lengths` (slime's get_responses at CP 1), which is
`own_loop.response_rows(packed=True)` with prompt length total_b - R_b.

Batch keys read: `total_lengths`, `response_lengths`, `loss_masks` ([R_b] each),
`advantages` ([R_b]), `rollout_log_probs` ([R_b], the engine's sampled-token logprobs),
`unconcat_tokens` ([total_b]: the sampled ids are its last R_b entries), and the top-K
`pdm_topk_ids` / `pdm_topk_logprobs` ([R_b, K] each, -inf logprob = unused slot).
Args read: `rollout_temperature`, `pdm_vocab_size` (the engine's vocabulary; megatron pads its
own), `pdm_loss` (a preset name or a PolicyLossConfig; default "pdm-agg"), `pdm_inplace` (default
False: the op then leaves the logits intact).

The loss is slime's per-sample mean: `sum_of_sample_mean(per_token_loss)` over the
concatenated response tokens (slime then scales it by micro-batches and data parallel size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from megatron_pdm import own_loop
from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.mcore.loss_adapter import _tp_group
from megatron_pdm.ops.support_torch import fold_support_torch

__all__ = ["pdm_loss"]


def _config(args: Any) -> PolicyLossConfig:
    cfg = getattr(args, "pdm_loss", "pdm-agg")
    return cfg if isinstance(cfg, PolicyLossConfig) else PolicyLossConfig.preset(str(cfg))


TOPK_KEYS = ("pdm_topk_ids", "pdm_topk_logprobs")


def _check_topk(batch: dict, resp: list[int]) -> None:
    """The top-K keys are there, one [R_b, K] tensor per sample (error names key and sample)."""
    for key in TOPK_KEYS:
        if batch.get(key) is None:
            raise ValueError(
                f"batch[{key!r}] is missing: slime must run megatron_pdm.integrations.slime's "
                "generate and convert_samples hooks and carry the key to the loss "
                "(megatron_pdm/integrations/slime/passthrough.patch; docs/own-loop.md, 'slime')")
        if len(batch[key]) != len(resp):
            raise ValueError(f"batch[{key!r}] has {len(batch[key])} samples, response_lengths "
                             f"{len(resp)}")
        for b, (x, r) in enumerate(zip(batch[key], resp)):
            if x.dim() != 2 or x.shape[0] != r:
                raise ValueError(f"batch[{key!r}] sample {b}: shape {tuple(x.shape)}, expected "
                                 f"[R={r}, K] (its response length)")


def pdm_loss(args: Any, batch: dict, logits: torch.Tensor,
             sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor], *,
             tp_group: Any = "parallel_state") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime custom loss: (loss, log) with loss = sum_of_sample_mean(per-token PDM loss)."""
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits {tuple(logits.shape)}: slime's packed [1, T, V_local] expected")
    vocab = getattr(args, "pdm_vocab_size", None)
    if vocab is None:
        raise ValueError("args.pdm_vocab_size is not set: the engine's vocabulary size (the loss "
                         "must know which of megatron's padded logits are real)")
    resp = [int(r) for r in batch["response_lengths"]]
    _check_topk(batch, resp)
    totals = [int(t) for t in batch["total_lengths"]]
    rows = own_loop.response_rows([t - r for t, r in zip(totals, resp)], resp, packed=True)
    cat = torch.cat
    sampled_R = cat([tok[-r:] for tok, r in zip(batch["unconcat_tokens"], resp)]).long()
    sampled_lp_R = cat(list(batch["rollout_log_probs"])).to(sampled_R.device).float()
    dev = sampled_R.device   # slime moves tokens to the GPU, not these keys (CPU tensors)
    top_ids_RK = cat(list(batch["pdm_topk_ids"])).to(dev)
    top_lp_RK = cat(list(batch["pdm_topk_logprobs"])).to(dev).float()
    ids, lp, valid, _ = fold_support_torch(top_ids_RK, top_lp_RK, torch.isfinite(top_lp_RK),
                                           sampled_R, sampled_lp_R)
    placed = own_loop.place_on_rows(
        logits, rows, sampled_ids=sampled_R, support_ids=ids, support_logprobs=lp,
        support_valid=valid, behavior_logprob=sampled_lp_R,
        advantages=cat(list(batch["advantages"])).float())
    loss_mask_R = cat(list(batch["loss_masks"])).to(torch.bool)
    lm_N = torch.zeros_like(placed.loss_mask)
    lm_N[rows.index - rows.lo] = loss_mask_R.to(lm_N.device)
    placed = dataclasses.replace(placed, loss_mask=lm_N)
    group = _tp_group() if tp_group == "parallel_state" else tp_group
    # not in place by default: this module cannot see whether slime reads the logits after the
    # custom loss (args.pdm_inplace=True opts in to the fast path, docs/own-loop.md)
    out = own_loop.loss_on_rows(placed, _config(args), tp_group=group, vocab_size=int(vocab),
                                temperature=float(getattr(args, "rollout_temperature", 1.0)),
                                inplace=bool(getattr(args, "pdm_inplace", False)))
    at_R = rows.index - rows.lo
    per_token_R = out.per_token_loss[at_R]
    masked_R = (~out.mask[at_R]).float()
    loss = sum_of_sample_mean(per_token_R)
    log = {"pg_loss": loss.detach(), "pdm_masked_frac": sum_of_sample_mean(masked_R).detach(),
           "pdm_ratio_mean": sum_of_sample_mean(out.ratio[at_R].float()).detach()}
    return loss, log
