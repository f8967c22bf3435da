"""The verl adapter's tensor logic, importable without verl (megatron_pdm/integrations/verl.py
wires it into verl 0.9.1; docs/own-loop.md, "verl").

Three pieces, each on verl-shaped tensors:

* `support_from_vllm_logprobs`: one vLLM completion's per-position logprob dicts (what vLLM
  returns with `SamplingParams(logprobs=K)`: the top-K and, when it is not among them, the
  sampled token; each value has `.logprob` and `.rank`) -> the folded behaviour support
  `[R, K+1]` ids and logprobs (-inf = unused slot), the layout of `megatron_pdm/ops/support.py`.
  `full_sequence_support` prepends the prompt's rows (all unused) so the support is aligned to
  the whole sequence, like verl's `input_ids`.
* `pdm_token_fields`: the logits-processor math. From the vocab-parallel logits rows (already
  divided by the rollout temperature, as verl's megatron engine does before its processor), the
  label each row scores and that row's support, it runs the family's op and loss once for
  A = +1 and once for A = -1 and returns the detached per-row weight
  `w = min(r, C) * M` (M the trust-region keep-mask, or the DRPO weight, times the token-level
  off-policy keep-mask) for each sign. The loss coefficient of the family is A * w(sign A), so
  `select_weight` with the real advantages gives it exactly (token-level configs; the
  sequence-level corrections need sequence ids and are refused).
* `select_weight`: picks w(sign A) per token (0 where A = 0).

Shape legend: B batch rows of the logits (1 for verl's packed THD), T rows, V_local the vocab
shard, S support slots, N = B * T, R response tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.loss.policy_loss import policy_loss
from megatron_pdm.ops.support_torch import fold_support_torch
from megatron_pdm.parallel.vocab_parallel import token_stats

__all__ = ["FIELD_KEYS", "check_token_level", "full_sequence_support", "pdm_token_fields",
           "select_weight", "support_from_vllm_logprobs"]

# the per-row outputs of the logits processor ([B, T] each, in the statistics' dtype: fp32, or
# fp64 for fp64 logits)
FIELD_KEYS = ("pdm_weight_pos", "pdm_weight_neg", "pdm_divergence", "pdm_has_support")


def check_token_level(cfg: PolicyLossConfig, where: str) -> None:
    """Refuses configs whose coefficient needs sequence ids (not per-token in verl's contract)."""
    if cfg.uses_sequences or cfg.seq_mask_kl is not None:
        raise ValueError(
            f"{where}: config {cfg.name or '(custom)'} uses sequence-level terms (aggregation "
            f"{cfg.aggregation!r}, is_level {cfg.is_level!r}, is_mask {cfg.is_mask!r}, "
            f"seq_mask_kl {cfg.seq_mask_kl!r}); the verl adapter computes per-token weights "
            "only: use a token-level config and verl's loss_agg_mode for the aggregation")


def support_from_vllm_logprobs(logprobs: Sequence[Mapping[int, Any]], token_ids: Sequence[int],
                               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-position logprob dicts -> (support ids [R, K+1] int64, logprobs [R, K+1] fp32).

    Args:
        logprobs: `CompletionOutput.logprobs`: R dicts {token id: Logprob(logprob, rank, ...)}
            with the top-`k` (rank 1..k) and the sampled token (any rank).
        token_ids: the R sampled ids (`CompletionOutput.token_ids`).
        k: the `logprobs` value the request used.

    Raises:
        ValueError: lengths differ, a position lacks the sampled token, a top-k rank is missing
            or repeated, or a logprob is NaN (the position and token are named).
    """
    if k < 1:
        raise ValueError(f"k={k}: request at least 1 top logprob (SamplingParams(logprobs=k))")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"logprobs has {len(logprobs)} positions, token_ids {len(token_ids)}")
    r = len(token_ids)
    top_ids_RK = torch.zeros(r, k, dtype=torch.int64)
    top_lp_RK = torch.full((r, k), -torch.inf, dtype=torch.float64)
    top_valid_RK = torch.zeros(r, k, dtype=torch.bool)
    sampled_lp_R = torch.empty(r, dtype=torch.float64)
    for pos, (entry, tok) in enumerate(zip(logprobs, token_ids)):
        if entry is None or int(tok) not in entry:
            raise ValueError(f"logprobs[{pos}]: the sampled token {int(tok)} is missing (vLLM "
                             "returns it with every position when SamplingParams.logprobs is set)")
        for tid, lp in entry.items():
            value, rank = float(lp.logprob), lp.rank
            if value != value:
                raise ValueError(f"logprobs[{pos}][{tid}]: logprob is NaN")
            if int(tid) == int(tok):
                sampled_lp_R[pos] = value
            if rank is None or not 1 <= int(rank) <= k:
                continue  # the sampled token outside the top-k
            slot = int(rank) - 1
            if top_valid_RK[pos, slot]:
                raise ValueError(f"logprobs[{pos}]: rank {rank} appears twice")
            top_ids_RK[pos, slot], top_lp_RK[pos, slot] = int(tid), value
            top_valid_RK[pos, slot] = True
    ids_RS, lp_RS, valid_RS, _ = fold_support_torch(
        top_ids_RK, top_lp_RK, top_valid_RK, torch.as_tensor(list(token_ids), dtype=torch.int64),
        sampled_lp_R)
    return ids_RS.long(), torch.where(valid_RS, lp_RS, -torch.inf)


def full_sequence_support(prompt_len: int, ids_RS: torch.Tensor, lp_RS: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepends `prompt_len` unused rows: [P + R, S] aligned to the sequence's tokens."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len}: verl needs a non-empty prompt")
    s = ids_RS.shape[-1]
    ids = torch.cat([ids_RS.new_zeros(prompt_len, s), ids_RS])
    lp = torch.cat([lp_RS.new_full((prompt_len, s), -torch.inf), lp_RS])
    return ids, lp


def _check_rows(logits_BTV: torch.Tensor, label_BT: torch.Tensor, support_ids_BTS: torch.Tensor,
                support_logprobs_BTS: torch.Tensor) -> None:
    if logits_BTV.dim() != 3:
        raise ValueError(f"logits: expected [B, T, V_local], got {tuple(logits_BTV.shape)}")
    bt = tuple(logits_BTV.shape[:2])
    if tuple(label_BT.shape) != bt:
        raise ValueError(f"label: expected {bt} (the logits' rows), got {tuple(label_BT.shape)}")
    for name, t in (("pdm_topk_ids", support_ids_BTS), ("pdm_topk_logprobs", support_logprobs_BTS)):
        if t.dim() != 3 or tuple(t.shape[:2]) != bt:
            raise ValueError(f"{name}: expected {bt + ('S',)} aligned to the logits' rows, "
                             f"got {tuple(t.shape)}")
    if support_ids_BTS.shape != support_logprobs_BTS.shape:
        raise ValueError(f"pdm_topk_ids {tuple(support_ids_BTS.shape)} and pdm_topk_logprobs "
                         f"{tuple(support_logprobs_BTS.shape)} differ in shape")
    if support_ids_BTS.dtype.is_floating_point or support_ids_BTS.dtype == torch.bool:
        raise ValueError(f"pdm_topk_ids: integer ids expected, got {support_ids_BTS.dtype}")


def pdm_token_fields(logits_BTV: torch.Tensor, label_BT: torch.Tensor,
                     support_ids_BTS: torch.Tensor, support_logprobs_BTS: torch.Tensor,
                     cfg: PolicyLossConfig, *, tp_group, vocab_size: int | None
                     ) -> dict[str, torch.Tensor]:
    """The per-row weights for A > 0 and A < 0, the divergence and the support flag ([B, T]).

    `logits_BTV` is this rank's vocab shard, already tempered (not modified here). Row t
    scores `label_BT[.., t]`; its behaviour support is `support_*_BTS[.., t]` (-inf logprob =
    unused slot) and must contain the label (`support_from_vllm_logprobs` folds it in): that
    slot's logprob is the behaviour logprob log mu_k. Rows without any valid slot (the prompt,
    padding) get weight 0 and `pdm_has_support` 0; a row with valid slots but not the label is a
    misaligned support and raises the op's SupportError naming the row. No gradient flows
    through the result.

    Collectives: those of `token_stats` on `tp_group` (2 all-reduces; none at TP 1).
    """
    check_token_level(cfg, "pdm_token_fields")
    _check_rows(logits_BTV, label_BT, support_ids_BTS, support_logprobs_BTS)
    b, t, v_local = logits_BTV.shape
    n, s = b * t, support_ids_BTS.shape[-1]
    lp_NS = support_logprobs_BTS.reshape(n, s).to(torch.float32)
    if torch.isnan(lp_NS).any():
        row = int(torch.isnan(lp_NS).any(-1).nonzero()[0, 0])
        raise ValueError(f"pdm_topk_logprobs: row {row} has a NaN logprob")
    ids_NS = support_ids_BTS.reshape(n, s)
    valid_NS = torch.isfinite(lp_NS)
    label_N = label_BT.reshape(n).long()
    match_NS = valid_NS & (ids_NS.long() == label_N[:, None])
    has_N = match_NS.any(-1)
    behav_N = torch.where(match_NS, lp_NS, -torch.inf).amax(-1)
    behav_N = torch.where(has_N, behav_N, 0.0)
    ids_NS = torch.where(valid_NS, ids_NS, 0).to(torch.int32)
    with torch.no_grad():
        # reshape is a view for verl's contiguous logits; inplace=False: verl reads the logits
        # again after its processor (its own log_probs)
        stats = token_stats(logits_BTV.detach().reshape(n, v_local), label_N, ids_NS, lp_NS,
                            valid_NS, tp_group=tp_group, vocab_size=vocab_size, inplace=False)
        out: dict[str, torch.Tensor] = {}
        for sign, key in ((1.0, "pdm_weight_pos"), (-1.0, "pdm_weight_neg")):
            adv_N = torch.full((n,), sign, dtype=stats.pi_k.dtype, device=logits_BTV.device)
            res = policy_loss(stats, adv_N, behav_N, has_N, cfg)
            # coeff = A * min(r, C) * M (0 off the kept rows): with A = +-1, w = A * coeff
            out[key] = (res.coeff * sign).reshape(b, t)
        out["pdm_divergence"] = torch.where(has_N, res.divergence, 0.0).reshape(b, t)
        out["pdm_has_support"] = has_N.to(res.coeff.dtype).reshape(b, t)
    return out


def select_weight(advantages: torch.Tensor, weight_pos: torch.Tensor, weight_neg: torch.Tensor
                  ) -> torch.Tensor:
    """w(sign A) per token, 0 where A = 0 (all three tensors the same shape)."""
    for name, w in (("pdm_weight_pos", weight_pos), ("pdm_weight_neg", weight_neg)):
        if w.shape != advantages.shape:
            raise ValueError(f"{name}: shape {tuple(w.shape)} differs from advantages "
                             f"{tuple(advantages.shape)}")
    zero = torch.zeros((), dtype=weight_pos.dtype, device=weight_pos.device)
    return torch.where(advantages > 0, weight_pos, torch.where(advantages < 0, weight_neg, zero))
