"""The masked policy-gradient surrogate of the whole family, in megatron-core's loss contract.

Given TokenStats from the vocab-parallel op, one function covers GRPO clip-higher, DPPO, PDM and
DRPO (docs/math.md §2.2, §3.4, §4.2, §5.1):

    r      = exp(clamp(log pi_k - log mu_k, +-20))              (detached, vs the ROLLOUT mu)
    D      = proximity divergence (config.proximity)
    away   = A (r - 1)  or  A * Ddot  (config.direction; TV ties per §3.6)
    mask   : coeff = A * min(r, C) * M,  M = 0 iff D > delta(sign A) and away > 0
    drpo   : coeff = A * min(r, C) * w,  w = 1 - sign(away) * D / delta(sign A)
    loss_t = -coeff_t * log pi_k(t)                             (only loss_mask rows)

Off-policy corrections (§10, ops/offpolicy.py) enter the same coefficient, for every trust
region: min(r, C) becomes min(rho_seq, C) with is_level="sequence", and the masked-IS and OPSM
keep-masks multiply M (or w). There is no second code path: with the §10 keys at their defaults
the coefficient is bit-for-bit the one above.

coeff is detached, so the gradient is exactly E[coeff * grad log pi_k] (§2.2); the only
differentiable input is stats.logprob. A = 0 tokens get no gradient and are left out of the
masked-fraction denominators (§6.8).

Aggregation (megatron-core divides the summed loss_sum by the summed num_tokens over
micro-batches and data-parallel ranks, so the pair must be chosen per aggregation):

    token-mean               (sum_t loss_t,                #loss tokens)
    seq-mean-token-sum       (sum_t loss_t,                #sequences with a loss token)
    seq-mean-token-sum-norm  (sum_t loss_t / loss_horizon, #sequences with a loss token)

Sequences are counted per call via `seq_ids` (sort-based, no host sync); a sequence split across
micro-batches is counted once per micro-batch (pack whole sequences per micro-batch for the
sequence aggregations and the sequence-level corrections, whose ratios are per call too).
seq_ids = -1 marks padding: with a sequence aggregation or correction such rows carry no loss (a
loss row with seq_id -1 is an input error when checked).

Input checks (`check_inputs=True`, the default) cost one host sync (more only to name the row of
an error): on loss rows, A and log mu_k finite, a support where the proximity needs one, a
non-negative seq_id under a sequence aggregation, and no -inf training logit on the sampled
token or on a valid support slot (docs/math.md §6.10: log pi_k = -inf makes the surrogate
undefined; pi_i = 0 on a slot with mu_i > 0 makes D_K = +inf, no number a threshold can use).
A caller whose batch was checked where it entered the system (the Megatron adapter with a
validated `PackedBatch`) turns them off and the function then runs without any device -> host
synchronisation. Unchecked, those inputs give: -inf log pi_k with A = 0 adds exactly 0; with
A != 0 an infinite loss_sum and a finite gradient (megatron reports the loss); a -inf support
slot counts as out of region (D_K = +inf), masked when moving away.

Thresholds are built in the statistics' dtype (a float64 run compares with the float64 delta).

Metrics (all tensor([sum, count]), detached; keys in metrics.py): pdm/masked_frac,
pdm/masked_frac_pos_adv, pdm/masked_frac_neg_adv, pdm/out_of_region_frac,
pdm/direction_disagree_frac, pdm/direction_uncertain_frac, pdm/divergence_mean, pdm/topk_kl_mean,
pdm/topk_tv_mean, pdm/pi_tail_mean, pdm/mu_tail_mean, pdm/abs_prob_diff, pdm/ratio_mean,
mismatch/abs_logprob_diff, mismatch/sampled_kl, loss/pg, pdm/drpo_weight_mean with
shaping="drpo", and offpolicy/is_weight_mean, offpolicy/masked_frac with a §10 correction on.

Shape legend: N tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm import metrics as M
from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.ops import direction as _direction
from megatron_pdm.ops import divergence as _div
from megatron_pdm.ops import masks as _masks
from megatron_pdm.ops import offpolicy as _offpolicy
from megatron_pdm.ops.stats import TokenStats

__all__ = ["PolicyLossOutput", "policy_loss"]

_NEEDS_SUPPORT = ("topk_kl", "topk_tv")


class PolicyLossOutput(tuple):
    """(loss_sum, num_tokens, metrics) with per-token extras as attributes.

    Attributes:
        mask: [N] bool keep-mask: the trust region's M (always True with shaping="drpo")
            and the §10 MIS / OPSM masks (True = kept).
        is_weight: [N] the detached importance weight min(r, C) or min(rho_seq, C) (§10).
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


@dataclass
class _Terms:
    """Detached per-token quantities of one call ([N] each)."""

    loss_mask: torch.Tensor
    adv: torch.Tensor
    logmu_k: torch.Tensor
    raw_log_ratio: torch.Tensor
    ratio: torch.Tensor
    divergence: torch.Tensor
    topk_ddot: torch.Tensor
    interval: tuple[torch.Tensor, torch.Tensor]
    away: torch.Tensor
    delta: torch.Tensor
    keep: torch.Tensor
    weight: torch.Tensor
    is_weight: torch.Tensor
    is_keep: torch.Tensor
    coeff: torch.Tensor


def _check_shapes(n: int, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")


def _check_values(stats: TokenStats, advantages: torch.Tensor, behavior_logprob: torch.Tensor,
                  lm_N: torch.Tensor, cfg: PolicyLossConfig, seq_ids: torch.Tensor | None
                  ) -> None:
    """The value checks of the module docstring on loss rows; one host sync when all pass."""
    if not lm_N.numel():
        return
    inputs_2N = torch.stack([advantages.to(torch.float64), behavior_logprob.to(torch.float64)])
    no_seq_N = (lm_N & (seq_ids < 0) if seq_ids is not None and cfg.uses_sequences
                else torch.zeros_like(lm_N))
    no_support_N = lm_N & ~stats.has_support
    if cfg.proximity not in _NEEDS_SUPPORT:
        no_support_N = torch.zeros_like(lm_N)
    dead_k_N = lm_N & (stats.logprob.detach() == -torch.inf)
    dead_slot_NS = lm_N[:, None] & stats.support_valid & ~stats.is_sampled & (
        stats.support_logprobs == -torch.inf)
    flags_PN = torch.stack([lm_N & ~torch.isfinite(inputs_2N[0]),
                            lm_N & ~torch.isfinite(inputs_2N[1]), no_seq_N, no_support_N,
                            dead_k_N, dead_slot_NS.any(-1)])
    if not bool(flags_PN.any()):  # the one host sync of the checks
        return
    which, row = (int(i) for i in flags_PN.nonzero()[0])
    if which < 2:
        name = ("advantages", "behavior_logprob")[which]
        raise ValueError(f"{name}: row {row} is {float(inputs_2N[which, row])} on a loss row")
    if which == 2:
        raise ValueError(f"seq_ids: row {row} is {int(seq_ids[row])} (padding) on a loss row; "
                         f"{_sequence_user(cfg)} needs its sequence id")
    if which == 3:
        raise ValueError(f"loss_mask row {row} has no valid support but {cfg.proximity} needs it")
    if which == 4:
        raise ValueError(f"logits: row {row}: the sampled token's training logit is -inf "
                         "(log pi_k = -inf) on a loss row: the training policy cannot emit the "
                         "token the rollout sampled (docs/math.md §6.10)")
    slot = int(dead_slot_NS[row].nonzero()[0, 0])
    sid = "?" if stats.support_ids is None else int(stats.support_ids[row, slot])
    raise ValueError(f"logits: row {row}, slot {slot}: the training logit of support id {sid} "
                     "is -inf (pi = 0) where mu > 0: D_K = +inf on a loss row "
                     "(docs/math.md §6.10)")


def _sequence_user(cfg: PolicyLossConfig) -> str:
    """What in `cfg` needs seq_ids (for error messages)."""
    if cfg.aggregation != "token-mean":
        return f"aggregation {cfg.aggregation!r}"
    if cfg.is_level == "sequence":
        return "is_level 'sequence'"
    if cfg.is_mask == "sequence":
        return "is_mask 'sequence'"
    return "seq_mask_kl (OPSM)"


def _off_policy(cfg: PolicyLossConfig, adv_N: torch.Tensor, raw_log_ratio_N: torch.Tensor,
                ratio_N: torch.Tensor, seq_ids_N: torch.Tensor | None, lm_N: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(importance weight min(r or rho, C), MIS x OPSM keep-mask) per token (§10)."""
    keep_N = torch.ones_like(lm_N)
    level_N = ratio_N
    if cfg.is_level == "sequence" or cfg.is_mask == "sequence":
        log_rho_N = _offpolicy.seq_log_ratio(raw_log_ratio_N, seq_ids_N, lm_N, cfg.seq_ratio)
        rho_N = log_rho_N.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp).exp()
        if cfg.is_level == "sequence":
            level_N = rho_N
        if cfg.is_mask == "sequence":
            keep_N = _offpolicy.within(rho_N, cfg.is_mask_low, cfg.is_mask_high)
    if cfg.is_mask == "token":
        keep_N = _offpolicy.within(ratio_N, cfg.is_mask_low, cfg.is_mask_high)
    if cfg.seq_mask_kl is not None:
        keep_N = keep_N & _offpolicy.opsm_keep(adv_N, raw_log_ratio_N, seq_ids_N, lm_N,
                                               cfg.seq_mask_kl)
    return level_N.clamp_max(cfg.ratio_cap), keep_N | ~lm_N  # off loss rows: nothing dropped


def _proximity(cfg: PolicyLossConfig, stats: TokenStats, ratio_N: torch.Tensor,
               logmu_k_N: torch.Tensor) -> torch.Tensor:
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


def _predictive_away(cfg: PolicyLossConfig, stats: TokenStats, adv_N: torch.Tensor,
                     logmu_k_N: torch.Tensor, topk_ddot_N: torch.Tensor) -> torch.Tensor:
    """A * Ddot of the configured divergence (the §3.6 one-sided rule for top-K TV)."""
    pi_k_N, mu_k_N = stats.pi_k, logmu_k_N.exp()
    # the exact complements 1 - pi_k and sum_{j != k} pi_j^2 (no cancellation near pi_k = 1)
    if cfg.proximity == "binary_kl":
        return adv_N * _direction.binary_kl_rate(pi_k_N, mu_k_N, stats.one_minus_pi_k,
                                                 stats.p2_not_k)
    if cfg.proximity == "binary_tv":
        return adv_N * _direction.binary_tv_rate(pi_k_N, mu_k_N, stats.one_minus_pi_k,
                                                 stats.p2_not_k)
    if cfg.divergence_kind == "tv":
        # §3.6 one-sided rule: ties move away from equality whatever the sign of A.
        return torch.sign(adv_N) * topk_ddot_N + stats.tv_tie_rate(cfg.tail) * (adv_N != 0)
    return adv_N * topk_ddot_N


def _token_terms(stats: TokenStats, advantages: torch.Tensor, behavior_logprob: torch.Tensor,
                 lm_N: torch.Tensor, cfg: PolicyLossConfig, seq_ids: torch.Tensor | None
                 ) -> _Terms:
    """Ratio, divergence, direction and the mask or DRPO weight of every token (detached).

    The top-K direction Ddot and the §7.2 interval are computed once here and shared by the
    direction, the noise-floor fallback and the metrics.
    """
    dtype = stats.pi_k.dtype
    adv_N = torch.where(lm_N, advantages.to(dtype), 0.0)
    logpi_k_N = stats.logprob.detach().to(dtype)
    logmu_k_N = torch.where(lm_N, behavior_logprob.to(dtype), logpi_k_N)
    raw_log_ratio_N = logpi_k_N - logmu_k_N
    ratio_N = raw_log_ratio_N.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp).exp()
    div_N = _proximity(cfg, stats, ratio_N, logmu_k_N)
    kind = cfg.divergence_kind if cfg.proximity not in ("ratio", "none") else "kl"
    topk_ddot_N = stats.divergence_rate(kind, cfg.tail)
    interval = stats.direction_interval()
    ratio_away_N = adv_N * (ratio_N - 1.0)
    if cfg.direction == "ratio":
        away_N = ratio_away_N
    else:
        away_N = _predictive_away(cfg, stats, adv_N, logmu_k_N, topk_ddot_N)
        if cfg.noise_floor is not None:
            # §7.5: use the predictive sign only where its correction to the local term exceeds
            # the certified-interval width plus the rollout logprob error.
            lower_N, upper_N = interval
            local_N = stats.pi_k - logmu_k_N.exp()
            cross_N = (stats.behavior_support_probs * stats.support_probs).sum(-1)
            bound_N = (upper_N - lower_N) + cfg.noise_floor * cross_N
            away_N = torch.where((topk_ddot_N - local_N).abs() > bound_N, away_N, ratio_away_N)
    delta_N = _masks.threshold(adv_N, cfg.delta_low, cfg.delta_high, dtype=dtype)
    if cfg.shaping == "mask":
        keep_N = _masks.keep_mask(div_N, away_N, delta_N) | (adv_N == 0) | ~lm_N
        weight_N = keep_N.to(dtype)
    else:
        keep_N = torch.ones_like(lm_N)
        weight_N = _masks.drpo_weight(div_N, away_N, delta_N)
    is_weight_N, is_keep_N = _off_policy(cfg, adv_N, raw_log_ratio_N, ratio_N, seq_ids, lm_N)
    coeff_N = torch.where(lm_N & is_keep_N, adv_N * is_weight_N * weight_N, 0.0)
    return _Terms(lm_N, adv_N, logmu_k_N, raw_log_ratio_N, ratio_N, div_N, topk_ddot_N,
                  interval, away_N, delta_N, keep_N, weight_N, is_weight_N, is_keep_N, coeff_N)


def _k3(ratio_N: torch.Tensor) -> torch.Tensor:
    """(r - 1) - log r per token: >= 0, unbiased for KL(mu || pi) under tokens drawn from mu."""
    return (ratio_N - 1.0) - ratio_N.log()


def _metrics(stats: TokenStats, t: _Terms, cfg: PolicyLossConfig,
             per_token_loss_N: torch.Tensor) -> dict[str, torch.Tensor]:
    dtype = stats.pi_k.dtype
    mdtype = torch.float64 if dtype == torch.float64 else torch.float32
    lm_N = t.loss_mask
    nz_N = lm_N & (t.adv != 0)
    sup_N = nz_N & stats.has_support
    lm_sup_N = lm_N & stats.has_support
    masked_N = ~t.keep
    lower_N, upper_N = t.interval
    uncertain_N = stats.has_support & (lower_N <= 0) & (upper_N >= 0)
    disagree_N = torch.sign(t.ratio - 1.0) != torch.sign(t.topk_ddot)
    out = {
        M.MASKED_FRAC: M.sum_count(masked_N, nz_N, mdtype),
        M.MASKED_FRAC_POS_ADV: M.sum_count(masked_N, nz_N & (t.adv > 0), mdtype),
        M.MASKED_FRAC_NEG_ADV: M.sum_count(masked_N, nz_N & (t.adv < 0), mdtype),
        M.OUT_OF_REGION_FRAC: M.sum_count(t.divergence > t.delta, nz_N, mdtype),
        M.DIRECTION_DISAGREE_FRAC: M.sum_count(disagree_N, sup_N, mdtype),
        M.DIRECTION_UNCERTAIN_FRAC: M.sum_count(uncertain_N, sup_N, mdtype),
        M.DIVERGENCE_MEAN: M.sum_count(t.divergence, lm_N, mdtype),
        M.TOPK_KL_MEAN: M.sum_count(stats.topk_kl, lm_sup_N, mdtype),
        M.TOPK_TV_MEAN: M.sum_count(stats.topk_tv, lm_sup_N, mdtype),
        M.PI_TAIL_MEAN: M.sum_count(stats.pi_tail, lm_sup_N, mdtype),
        M.MU_TAIL_MEAN: M.sum_count(stats.mu_tail, lm_sup_N, mdtype),
        M.ABS_PROB_DIFF: M.sum_count((stats.pi_k - t.logmu_k.exp()).abs(), lm_N, mdtype),
        M.RATIO_MEAN: M.sum_count(t.ratio, lm_N, mdtype),
        M.ABS_LOGPROB_DIFF: M.sum_count(t.raw_log_ratio.abs(), lm_N, mdtype),
        M.SAMPLED_KL: M.sum_count(_k3(t.ratio), lm_N, mdtype),
        M.LOSS_PG: M.sum_count(per_token_loss_N, lm_N, mdtype),
    }
    if cfg.shaping == "drpo":
        out[M.DRPO_WEIGHT_MEAN] = M.sum_count(t.weight, lm_N, mdtype)
    if cfg.off_policy:
        out[M.IS_WEIGHT_MEAN] = M.sum_count(t.is_weight, lm_N, mdtype)
        out[M.OFFPOLICY_MASKED_FRAC] = M.sum_count(~t.is_keep, nz_N, mdtype)
    return out


def policy_loss(
    stats: TokenStats,
    advantages: torch.Tensor,
    behavior_logprob: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> PolicyLossOutput:
    """Masked / shaped policy-gradient loss in megatron-core's (loss_sum, num_tokens, metrics).

    Args:
        stats: TokenStats from `token_stats` (stats.logprob carries the gradient).
        advantages: [N] A per token (broadcast sequence advantage).
        behavior_logprob: [N] log mu_k of the sampled token (tempered rollout logprob).
        loss_mask: [N] bool (or 0/1), rows that carry a loss.
        cfg: the method.
        seq_ids: [N] int sample index (-1 = padding); required by the sequence aggregations.
        check_inputs: check the values (one host sync, see the module docstring); off for
            batches checked at the boundary: then no host synchronisation at all.

    Returns:
        PolicyLossOutput: (loss_sum scalar, num_tokens int scalar, metrics), plus .mask, .coeff,
        .per_token_loss, .divergence, .away_score, .ratio. See the module docstring.

    Raises:
        ValueError: shape mismatches, missing seq_ids, and (with check_inputs) on loss rows:
            non-finite advantages or behavior logprobs, no support where the config needs one,
            seq_id -1 under a sequence aggregation, a -inf training logit on the sampled token
            or a valid support slot (row and slot named).
    """
    n = stats.logprob.shape[0]
    _check_shapes(n, advantages=advantages, behavior_logprob=behavior_logprob,
                  loss_mask=loss_mask, seq_ids=seq_ids)
    if cfg.uses_sequences and seq_ids is None:
        raise ValueError(f"{_sequence_user(cfg)} needs seq_ids")
    lm_N = loss_mask.to(torch.bool)
    if check_inputs:
        _check_values(stats, advantages, behavior_logprob, lm_N, cfg, seq_ids)
    if cfg.uses_sequences:
        lm_N = lm_N & (seq_ids >= 0)  # padding rows carry no loss (checked above when on)
    with torch.no_grad():
        t = _token_terms(stats, advantages, behavior_logprob, lm_N, cfg, seq_ids)

    # coeff = 0 rows add exactly 0 (also where log pi_k = -inf: no 0 * -inf = NaN)
    live_N = lm_N & (t.coeff != 0)
    per_token_loss_N = torch.where(live_N, -t.coeff.to(stats.logprob.dtype) * stats.logprob, 0.0)
    loss_sum = per_token_loss_N.sum()
    if cfg.aggregation == "token-mean":
        num = lm_N.sum()
    else:
        num = _offpolicy.num_sequences(seq_ids, lm_N)
        if cfg.aggregation == "seq-mean-token-sum-norm":
            loss_sum = loss_sum / float(cfg.loss_horizon)
    with torch.no_grad():
        metrics = _metrics(stats, t, cfg, per_token_loss_N)
    return PolicyLossOutput(
        loss_sum,
        num.to(torch.int),
        metrics,
        mask=t.keep & t.is_keep,
        coeff=t.coeff,
        is_weight=t.is_weight,
        per_token_loss=per_token_loss_N,
        divergence=t.divergence,
        away_score=t.away,
        ratio=t.ratio,
    )
