"""megatron-pdm: GRPO, DPPO, PDM and DRPO trust regions as one vocab-parallel op for Megatron-core.

Public API (never imports megatron):

    stats = token_stats(logits, sampled_ids, support_ids, support_logprobs, support_valid,
                        *, tp_group=None, vocab_size=None, temperature=1.0)
    cfg   = PolicyLossConfig.preset("pdm-agg")
    out   = policy_loss(stats, advantages, behavior_logprob, loss_mask, cfg, seq_ids=None)
    loss_sum, num_tokens, metrics = out
"""

from megatron_pdm.config import PRESETS, PolicyLossConfig
from megatron_pdm.loss.policy_loss import PolicyLossOutput, policy_loss
from megatron_pdm.ops.stats import TokenStats
from megatron_pdm.parallel.vocab_parallel import token_stats

__all__ = [
    "PRESETS",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "TokenStats",
    "policy_loss",
    "token_stats",
]
