"""The trust-region keep-mask and the DRPO weight, from (D, direction, advantage sign).

Every method of the family factors into three independent axes (docs/math.md §2.1, §3.4, §4.2):

* proximity: a divergence D compared with an advantage-sign-aware threshold delta(sign A)
  (|r - 1| for PPO/GRPO clipping, Binary/Top-K TV/KL for DPPO and PDM);
* direction: is the token's update "moving away"? PPO/DPPO use sign(A (r - 1)) > 0; PDM uses
  sign(A * Ddot) > 0 with Ddot the predicted change of D itself (TV uses the one-sided tie rule
  of §3.6, passed in as an already-evaluated "away" score);
* shaping: a hard mask M = 0 iff D > delta and moving away, or DRPO's smooth weight
  w = 1 - s * D / delta with s = +1 moving away, -1 moving back (§4.2: D = |pi_k - mu_k|).

Tokens with A = 0 carry no gradient; they are kept (M = 1) and excluded from mask metrics.

Shape legend: N tokens.
"""

from __future__ import annotations

import torch

__all__ = ["threshold", "keep_mask", "drpo_weight"]


def threshold(adv_N: torch.Tensor, delta_low: float, delta_high: float,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """delta(sign A): delta_high where A > 0, delta_low where A < 0 (and A == 0).

    Built directly in `dtype` (default: the advantages' float dtype, else float32) from the
    Python floats, so a float64 statistic is compared with the float64 delta (0.15, not the
    float32 0.15000000596); no host transfer (the scalars are kernel arguments).
    """
    if dtype is None:
        dtype = adv_N.dtype if adv_N.is_floating_point() else torch.float32
    out_N = torch.full(adv_N.shape, float(delta_low), dtype=dtype, device=adv_N.device)
    return out_N.masked_fill_(adv_N > 0, float(delta_high))


def keep_mask(
    divergence_N: torch.Tensor, away_score_N: torch.Tensor, delta_N: torch.Tensor
) -> torch.Tensor:
    """M = 0 iff D > delta and the update moves away (away_score > 0); True means keep.

    Args:
        divergence_N: proximity divergence D.
        away_score_N: > 0 when the token's step increases D (e.g. A * (r - 1), A * Ddot).
        delta_N: per-token threshold.

    Returns:
        [N] bool keep-mask.
    """
    return ~((divergence_N > delta_N) & (away_score_N > 0))


def drpo_weight(
    divergence_N: torch.Tensor, away_score_N: torch.Tensor, delta_N: torch.Tensor
) -> torch.Tensor:
    """DRPO's weight w = 1 - sign(away) * D / delta (§4.2); 1 when the direction is neutral."""
    return 1.0 - torch.sign(away_score_N) * divergence_N / delta_N
