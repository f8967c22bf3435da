"""The masked policy-gradient surrogate of the whole family, in megatron-core's loss contract.

Given TokenStats from the vocab-parallel op, one function covers GRPO clip-higher, DPPO, PDM and
DRPO (algorithms.md §2.2, §3.4, §4.2, §5.1):

    r      = exp(clamp(log pi_k - log mu_k, +-20))              (detached, vs the ROLLOUT mu)
    D      = proximity divergence (config.proximity)
    away   = A (r - 1)  or  A * Ddot  (config.direction; TV ties per §3.6)
    mask   : coeff = A * min(r, C) * M,  M = 0 iff D > delta(sign A) and away > 0
    drpo   : coeff = A * min(r, C) * w,  w = 1 - sign(away) * D / delta(sign A)
    loss_t = -coeff_t * log pi_k(t)                             (only loss_mask rows)

coeff is detached, so the gradient is exactly E[coeff * grad log pi_k] (§2.2); the only
differentiable input is stats.logprob. A = 0 tokens get no gradient and are left out of the
masked-fraction denominators (§6.8).

Aggregation (megatron-core divides the summed loss_sum by the summed num_tokens over
micro-batches and data-parallel ranks, so the pair must be chosen per aggregation):

    token-mean               (sum_t loss_t,                #loss tokens)
    seq-mean-token-sum       (sum_t loss_t,                #sequences with a loss token)
    seq-mean-token-sum-norm  (sum_t loss_t / loss_horizon, #sequences with a loss token)

Sequences are counted per call via `seq_ids`; a sequence split across micro-batches is counted
once per micro-batch (pack whole sequences per micro-batch for the sequence aggregations).

Metrics (all tensor([sum, count]), detached; keys in metrics.py): pdm/masked_frac,
pdm/masked_frac_pos_adv, pdm/masked_frac_neg_adv, pdm/out_of_region_frac,
pdm/direction_disagree_frac, pdm/direction_uncertain_frac, pdm/divergence_mean, pdm/topk_kl_mean,
pdm/topk_tv_mean, pdm/pi_tail_mean, pdm/mu_tail_mean, pdm/abs_prob_diff, pdm/ratio_mean,
mismatch/abs_logprob_diff, loss/pg, and pdm/drpo_weight_mean with shaping="drpo".

Shape legend: N tokens.
"""

from __future__ import annotations

import torch

from megatron_pdm import metrics as M
from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.ops import direction as _direction
from megatron_pdm.ops import divergence as _div
from megatron_pdm.ops import masks as _masks
from megatron_pdm.ops.stats import TokenStats

__all__ = ["PolicyLossOutput", "policy_loss"]

_NEEDS_SUPPORT = ("topk_kl", "topk_tv")


class PolicyLossOutput(tuple):
    """(loss_sum, num_tokens, metrics) with per-token extras as attributes.

    Attributes:
        mask: [N] bool keep-mask M (True = kept; always True with shaping="drpo").
        coeff: [N] detached coefficient (0 off loss rows).
        per_token_loss: [N] -coeff * log pi_k (differentiable, 0 off loss rows).
        divergence: [N] the proximity divergence D used.
        away_score: [N] the direction score (> 0 means the update moves away).
        ratio: [N] the (clamped) importance ratio r.
    """

    def __new__(cls, loss_sum, num_tokens, metrics, **extras):
        self = super().__new__(cls, (loss_sum, num_tokens, metrics))
        for key, value in extras.items():
            setattr(self, key, value)
        return self

    @property
    def loss_sum(self) -> torch.Tensor:
        return self[0]

    @property
    def num_tokens(self) -> torch.Tensor:
        return self[1]

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        return self[2]


def _check_shapes(n: int, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")


def _proximity(cfg, stats, ratio_N, logmu_k_N) -> torch.Tensor:
    logpi_k_N = stats.logprob.detach().to(ratio_N.dtype)
    if cfg.proximity == "ratio":
        return (ratio_N - 1.0).abs()
    if cfg.proximity == "binary_tv":
        return _div.binary_tv(logpi_k_N, logmu_k_N)
    if cfg.proximity == "binary_kl":
        return _div.binary_kl(logpi_k_N, stats.log1m_pi_k, logmu_k_N)
    if cfg.proximity == "topk_tv":
        return stats.topk_tv
    if cfg.proximity == "topk_kl":
        return stats.topk_kl
    return torch.zeros_like(ratio_N)


def _predictive_score(cfg, stats, adv_N, logmu_k_N) -> tuple[torch.Tensor, torch.Tensor]:
    """(away score, Ddot) for the predictive direction of the configured divergence."""
    pi_k_N, mu_k_N = stats.pi_k, logmu_k_N.exp()
    if cfg.proximity == "binary_kl":
        ddot = _direction.binary_kl_rate(pi_k_N, mu_k_N, stats.log1m_pi_k.exp(), stats.p2)
        return adv_N * ddot, ddot
    if cfg.proximity == "binary_tv":
        ddot = _direction.binary_tv_rate(pi_k_N, mu_k_N, stats.p2)
        return adv_N * ddot, ddot
    ddot = stats.divergence_rate(cfg.divergence_kind, cfg.tail)
    if cfg.divergence_kind == "tv":
        # §3.6 one-sided rule: ties move away from equality whatever the sign of A.
        return torch.sign(adv_N) * ddot + stats.tv_tie_rate(cfg.tail) * (adv_N != 0), ddot
    return adv_N * ddot, ddot


def policy_loss(
    stats: TokenStats,
    advantages: torch.Tensor,
    behavior_logprob: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Masked / shaped policy-gradient loss in megatron-core's (loss_sum, num_tokens, metrics).

    Args:
        stats: TokenStats from `token_stats` (stats.logprob carries the gradient).
        advantages: [N] A per token (broadcast sequence advantage).
        behavior_logprob: [N] log mu_k of the sampled token (tempered rollout logprob).
        loss_mask: [N] bool (or 0/1), rows that carry a loss.
        cfg: the method.
        seq_ids: [N] int sample index (-1 = padding); required by the sequence aggregations.

    Returns:
        PolicyLossOutput: (loss_sum scalar, num_tokens int scalar, metrics), plus .mask, .coeff,
        .per_token_loss, .divergence, .away_score, .ratio. See the module docstring.

    Raises:
        ValueError: shape mismatches, missing seq_ids, non-finite advantages or behavior
            logprobs on loss rows, or loss rows without a support when the config needs one
            (row named).
    """
    n = stats.logprob.shape[0]
    _check_shapes(n, advantages=advantages, behavior_logprob=behavior_logprob,
                  loss_mask=loss_mask, seq_ids=seq_ids)
    dtype = stats.pi_k.dtype
    lm_N = loss_mask.to(torch.bool)
    needs_support = cfg.proximity in _NEEDS_SUPPORT
    if needs_support and n and bool((lm_N & ~stats.has_support).any()):
        row = int((lm_N & ~stats.has_support).nonzero()[0, 0])
        raise ValueError(f"loss_mask row {row} has no valid support but {cfg.proximity} needs it")
    inputs_2N = torch.stack([advantages.to(torch.float64), behavior_logprob.to(torch.float64)])
    bad_2N = lm_N & ~torch.isfinite(inputs_2N)
    if n and bool(bad_2N.any()):  # one host sync for both checks
        which, row = (int(i) for i in bad_2N.nonzero()[0])
        name = ("advantages", "behavior_logprob")[which]
        raise ValueError(f"{name}: row {row} is {float(inputs_2N[which, row])} on a loss row")
    if cfg.aggregation != "token-mean" and seq_ids is None:
        raise ValueError(f"aggregation {cfg.aggregation!r} needs seq_ids")

    with torch.no_grad():
        adv_N = torch.where(lm_N, advantages.to(dtype), 0.0)
        logpi_k_N = stats.logprob.detach().to(dtype)
        logmu_k_N = torch.where(lm_N, behavior_logprob.to(dtype), logpi_k_N)
        raw_log_ratio_N = logpi_k_N - logmu_k_N
        log_ratio_N = raw_log_ratio_N.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        ratio_N = log_ratio_N.exp()
        div_N = _proximity(cfg, stats, ratio_N, logmu_k_N)
        ratio_score_N = adv_N * (ratio_N - 1.0)
        if cfg.direction == "ratio":
            away_N = ratio_score_N
        else:
            away_N, ddot_N = _predictive_score(cfg, stats, adv_N, logmu_k_N)
            if cfg.noise_floor is not None:
                lower_N, upper_N = stats.direction_interval()
                local_N = stats.pi_k - logmu_k_N.exp()
                cross_N = (stats.behavior_support_probs * stats.support_probs).sum(-1)
                bound_N = (upper_N - lower_N) + cfg.noise_floor * cross_N
                away_N = torch.where((ddot_N - local_N).abs() > bound_N, away_N, ratio_score_N)
        delta_N = _masks.threshold(adv_N, cfg.delta_low, cfg.delta_high).to(dtype)
        capped_N = ratio_N.clamp_max(cfg.ratio_cap)
        if cfg.shaping == "mask":
            keep_N = _masks.keep_mask(div_N, away_N, delta_N) | (adv_N == 0) | ~lm_N
            weight_N = keep_N.to(dtype)
        else:
            keep_N = torch.ones_like(lm_N)
            weight_N = _masks.drpo_weight(div_N, away_N, delta_N)
        coeff_N = torch.where(lm_N, adv_N * capped_N * weight_N, 0.0)

    per_token_loss_N = torch.where(lm_N, -coeff_N.to(stats.logprob.dtype) * stats.logprob, 0.0)
    loss_sum = per_token_loss_N.sum()
    if cfg.aggregation == "token-mean":
        num = lm_N.sum()
    else:
        live = lm_N & (seq_ids >= 0)
        num = torch.tensor(torch.unique(seq_ids[live]).numel(), device=lm_N.device)
        if cfg.aggregation == "seq-mean-token-sum-norm":
            loss_sum = loss_sum / float(cfg.loss_horizon)
    num_tokens = num.to(torch.int)

    with torch.no_grad():
        mdtype = torch.float64 if dtype == torch.float64 else torch.float32
        nz_N = lm_N & (adv_N != 0)
        sup_N = nz_N & stats.has_support
        masked_N = ~keep_N
        kind = cfg.divergence_kind if cfg.proximity not in ("ratio", "none") else "kl"
        pred_ddot_N = stats.divergence_rate(kind, cfg.tail)
        disagree_N = torch.sign(ratio_N - 1.0) != torch.sign(pred_ddot_N)
        out = {
            M.MASKED_FRAC: M.sum_count(masked_N, nz_N, mdtype),
            M.MASKED_FRAC_POS_ADV: M.sum_count(masked_N, nz_N & (adv_N > 0), mdtype),
            M.MASKED_FRAC_NEG_ADV: M.sum_count(masked_N, nz_N & (adv_N < 0), mdtype),
            M.OUT_OF_REGION_FRAC: M.sum_count(div_N > delta_N, nz_N, mdtype),
            M.DIRECTION_DISAGREE_FRAC: M.sum_count(disagree_N, sup_N, mdtype),
            M.DIRECTION_UNCERTAIN_FRAC: M.sum_count(stats.direction_uncertain, sup_N, mdtype),
            M.DIVERGENCE_MEAN: M.sum_count(div_N, lm_N, mdtype),
            M.TOPK_KL_MEAN: M.sum_count(stats.topk_kl, lm_N & stats.has_support, mdtype),
            M.TOPK_TV_MEAN: M.sum_count(stats.topk_tv, lm_N & stats.has_support, mdtype),
            M.PI_TAIL_MEAN: M.sum_count(stats.pi_tail, lm_N & stats.has_support, mdtype),
            M.MU_TAIL_MEAN: M.sum_count(stats.mu_tail, lm_N & stats.has_support, mdtype),
            M.ABS_PROB_DIFF: M.sum_count((stats.pi_k - logmu_k_N.exp()).abs(), lm_N, mdtype),
            M.RATIO_MEAN: M.sum_count(ratio_N, lm_N, mdtype),
            M.ABS_LOGPROB_DIFF: M.sum_count(raw_log_ratio_N.abs(), lm_N, mdtype),
            M.LOSS_PG: M.sum_count(per_token_loss_N, lm_N, mdtype),
        }
        if cfg.shaping == "drpo":
            out[M.DRPO_WEIGHT_MEAN] = M.sum_count(weight_N, lm_N, mdtype)

    return PolicyLossOutput(
        loss_sum,
        num_tokens,
        out,
        mask=keep_N,
        coeff=coeff_N,
        per_token_loss=per_token_loss_N,
        divergence=div_N,
        away_score=away_N,
        ratio=ratio_N,
    )
