"""Pure-torch math of the trust-region family: divergences, Ddot estimators, masks, the oracle."""

from megatron_pdm.ops.divergence import binary_kl, binary_tv, log1mexp, tail_mass, topk_kl, topk_tv
from megatron_pdm.ops.stats import TokenStats, assemble_token_stats

__all__ = [
    "TokenStats",
    "assemble_token_stats",
    "binary_kl",
    "binary_tv",
    "log1mexp",
    "tail_mass",
    "topk_kl",
    "topk_tv",
]
