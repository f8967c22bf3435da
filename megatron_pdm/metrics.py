"""Metric keys and the [sum, count] convention of megatron-core's loss contract.

Every metric is a detached 2-vector tensor([sum, count]); megatron-core sums these over
micro-batches and data-parallel ranks, so sum / count is an exact mean over all counted tokens.
The keys are constants here so that trainer logging, plots and tests share one spelling.
"""

from __future__ import annotations

import torch

MASKED_FRAC = "pdm/masked_frac"
"""Fraction of loss tokens with A != 0 whose keep-mask is 0."""
MASKED_FRAC_POS_ADV = "pdm/masked_frac_pos_adv"
"""Masked fraction among loss tokens with A > 0."""
MASKED_FRAC_NEG_ADV = "pdm/masked_frac_neg_adv"
"""Masked fraction among loss tokens with A < 0."""
OUT_OF_REGION_FRAC = "pdm/out_of_region_frac"
"""Fraction of loss tokens with A != 0 and D > delta(sign A)."""
DIRECTION_DISAGREE_FRAC = "pdm/direction_disagree_frac"
"""Fraction (A != 0, with support) where sign(A (r-1)) != sign(A Ddot) (ratio vs predictive)."""
DIRECTION_UNCERTAIN_FRAC = "pdm/direction_uncertain_frac"
"""Fraction (A != 0, with support) whose §7.2 certified full-KL interval straddles 0."""
DIVERGENCE_MEAN = "pdm/divergence_mean"
"""Mean of the proximity divergence D used by the mask, over loss tokens."""
TOPK_KL_MEAN = "pdm/topk_kl_mean"
TOPK_TV_MEAN = "pdm/topk_tv_mean"
PI_TAIL_MEAN = "pdm/pi_tail_mean"
MU_TAIL_MEAN = "pdm/mu_tail_mean"
ABS_PROB_DIFF = "pdm/abs_prob_diff"
"""Mean |pi_k - mu_k| over loss tokens (the mismatch curve of the DPPO paper)."""
RATIO_MEAN = "pdm/ratio_mean"
DRPO_WEIGHT_MEAN = "pdm/drpo_weight_mean"
"""Mean DRPO weight w over loss tokens (only with shaping='drpo')."""
IS_WEIGHT_MEAN = "offpolicy/is_weight_mean"
"""Mean importance weight min(r, C) or min(rho_seq, C) over loss tokens (with a docs/math.md
§10 correction on: is_level "sequence", is_mask or seq_mask_kl)."""
OFFPOLICY_MASKED_FRAC = "offpolicy/masked_frac"
"""Fraction of loss tokens with A != 0 dropped by masked IS or the OPSM sequence mask (§10)."""
ABS_LOGPROB_DIFF = "mismatch/abs_logprob_diff"
"""Mean |log pi_k - log mu_k| over loss tokens."""
SAMPLED_KL = "mismatch/sampled_kl"
"""Mean of (r - 1) - log r over loss tokens (r = pi_k / mu_k, log r clamped as the loss does):
the non-negative unbiased estimate of KL(mu || pi) from tokens sampled from mu."""
LOSS_PG = "loss/pg"
"""Policy-gradient surrogate: sum of per-token losses and the number of loss tokens."""
TOKENS_LOSS = "tokens/loss"
"""Loss rows of a micro-batch (the Megatron adapter adds it)."""
SFT_LOSS = "sft/loss"
"""Cross-entropy of the supervised warm-up on answer rows."""

# Driver rows (one per optimizer step in metrics.jsonl; not [sum, count] pairs).
STEP = "step"
ITERATION = "iteration"
MINIBATCH = "minibatch"
EPOCH = "epoch"
"""Pass over the rollout batch (train.epochs_per_batch), 0-based."""
STEPS_THIS_BATCH = "train/steps_this_batch"
"""Optimizer steps taken on the iteration's rollout batch so far, this one included (counted
where the step runs; the last row of an iteration holds steps per batch)."""
ENTROPY_SAMPLED = "rollout/entropy"
"""Mean of -log mu over the batch's sampled response tokens: the Monte-Carlo estimate of the
per-token entropy of the (tempered) rollout policy."""
LR = "lr"
GRAD_NORM = "grad_norm"
REWARD_MEAN = "reward/mean"
"""Mean reward of the iteration's rollouts (sampled at the rollout temperature)."""
REWARD_FRAC_SOLVED_GROUPS = "reward/frac_solved_groups"
"""Fraction of GRPO groups with at least one rewarded sample."""
RESPONSE_LEN = "rollout/response_len"
WEIGHT_VERSION = "rollout/weight_version"
"""Weight version that generated the iteration's rollouts (the engine's sync counter)."""
STALENESS = "rollout/staleness"
"""Trainer weight version minus the rollouts' (0 on-policy; 1 with rollout.overlap after the
first iteration): how many optimizer updates behind the behaviour policy mu is."""
NUM_SAMPLES = "rollout/num_samples"
"""Samples in the iteration's batch (prompts x group size: a rollout engine never drops one)."""
TIME_ROLLOUT = "time/rollout_s"
"""Time the loop waited for the iteration's rollouts (with rollout.overlap: the collect only)."""
TIME_UNIX = "time/unix_s"
"""Wall-clock time the row was written (iteration rates; excluded from exactness checks)."""
TIME_TRAIN_STEP = "time/train_step_s"
"""The optimizer step's wall-clock time (TIME_FWD_BWD + TIME_OPTIMIZER + metric reduction)."""
TIME_FWD_BWD = "time/fwd_bwd_s"
"""Zeroing, forward and backward of the step's micro-batches (gradients finalised)."""
TIME_OPTIMIZER = "time/optimizer_s"
"""The optimizer's update (clipping included)."""
TIME_WEIGHT_SYNC = "time/weight_sync_s"
"""The weight push after the iteration's last step (on its last row; 0 on the others)."""
TIME_ITERATION = "time/iteration_s"
"""Wall-clock time of the whole iteration, push included (on its last row; 0 on the others);
minus the phases above it leaves scoring, packing and logging."""
PAD_FRAC = "rollout/pad_frac"
"""Fraction of the packed [b, s] token slots that are padding (right padding to the longest
prompt + response of the batch): forward/backward work spent on no token."""

ALL_KEYS = (
    MASKED_FRAC, MASKED_FRAC_POS_ADV, MASKED_FRAC_NEG_ADV, OUT_OF_REGION_FRAC,
    DIRECTION_DISAGREE_FRAC, DIRECTION_UNCERTAIN_FRAC, DIVERGENCE_MEAN, TOPK_KL_MEAN,
    TOPK_TV_MEAN, PI_TAIL_MEAN, MU_TAIL_MEAN, ABS_PROB_DIFF, RATIO_MEAN, DRPO_WEIGHT_MEAN,
    IS_WEIGHT_MEAN, OFFPOLICY_MASKED_FRAC, ABS_LOGPROB_DIFF, SAMPLED_KL, LOSS_PG,
)


def sum_count(values_N: torch.Tensor, where_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor([sum of values where `where_N`, count of `where_N`]), detached, in `dtype`."""
    with torch.no_grad():
        sel = where_N.to(torch.bool)
        total = torch.where(sel, values_N.detach().to(dtype), 0.0).sum()
        return torch.stack([total, sel.sum().to(dtype)])


def mean_of(metric: torch.Tensor) -> float:
    """sum / count of one [sum, count] metric (nan when the count is 0)."""
    s, c = metric.tolist()
    return s / c if c else float("nan")


def reduce_metrics(forward_data_store: list[dict], group=None) -> dict[str, float]:
    """Sums the per-micro-batch `[sum, count]` metrics, all-reduces them over `group` (the DP
    group when data is split over ranks) and returns the means.

    Args:
        forward_data_store: one `{key: tensor([sum, count])}` per micro-batch (what megatron's
            forward_backward_func returns, or the metrics of your own loop's loss calls).
        group: a process group, or None (no communication).
    """
    totals: dict[str, torch.Tensor] = {}
    for item in forward_data_store:
        for key, value in item.items():
            v = value.detach().to(torch.float64)
            totals[key] = totals[key] + v if key in totals else v.clone()
    if group is not None and totals:
        import torch.distributed as dist

        keys = sorted(totals)
        packed = torch.stack([totals[k] for k in keys])
        dist.all_reduce(packed, group=group)  # SUM of [sum, count] over data-parallel ranks
        totals = dict(zip(keys, packed))
    return {k: mean_of(v) for k, v in totals.items()}
