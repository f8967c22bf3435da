"""Off-policy corrections: truncated and masked importance sampling, token and sequence level.

docs/math.md §10. With r_t = pi_k / mu_k (the loss's detached, clamped token ratio) and the loss
rows L_s of sequence s (one call: a sequence split over micro-batches is corrected per part),

    log rho_s = sum_{t in L_s} log r_t                 seq_ratio = "product"
              = (1 / |L_s|) sum_{t in L_s} log r_t     seq_ratio = "geometric"
    rho_s     = exp(clamp(log rho_s, +-log_ratio_clamp))

(verl's rollout correction forms its "sequence" and "geometric" levels the same way, summing or
averaging the unclamped token log ratios and clamping the result before exp:
https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/rollout_corr_helper.py).

    TIS  weight w_t = min(r_t, C) (token) or min(rho_s(t), C) (sequence); C = ratio_cap
         (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
         https://fengyao.notion.site/off-policy-rl)
    MIS  keep_t = lo <= r_t <= hi (token) or lo <= rho_s(t) <= hi (sequence), bounds inclusive
         as in verl's rejection mask; lo defaults to 1 / hi there and here
    OPSM keep_t = not (A_t < 0 and kl_s(t) > delta),  kl_s = (1/|L_s|) sum_{t in L_s} log(mu/pi)
         (DeepSeek-V3.2's off-policy sequence masking as slime implements it:
         https://github.com/THUDM/slime/blob/main/slime/utils/ppo_utils.py, compute_opsm_mask)

Everything is detached and runs without a host sync: sequences are found by sorting the ids
(no unique, no nonzero), so segment sums are [N] scatter-adds.

Shape legend: N tokens.
"""

from __future__ import annotations

import torch

__all__ = ["num_sequences", "opsm_keep", "segment_sum_count", "seq_log_ratio", "within"]


def segment_sum_count(values_N: torch.Tensor, seq_ids_N: torch.Tensor, live_N: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the sum of `values_N` and the count over the live rows of its sequence.

    Rows that are not live get the sums of the dead rows' common segment (meaningless; callers
    read live rows only). No host sync: sort, run starts, cumsum, two [N] scatter-adds.
    """
    n = values_N.shape[0]
    if n == 0:
        return values_N.clone(), values_N.clone()
    keyed_N = torch.where(live_N, seq_ids_N.long(), -1)
    sorted_N, order_N = torch.sort(keyed_N, stable=True)
    starts_N = torch.ones_like(sorted_N, dtype=torch.long)
    starts_N[1:] = (sorted_N[1:] != sorted_N[:-1]).long()
    seg_sorted_N = torch.cumsum(starts_N, 0) - 1            # segment index in [0, N)
    seg_N = torch.empty_like(seg_sorted_N).scatter_(0, order_N, seg_sorted_N)
    live_vals_N = torch.where(live_N, values_N, 0.0)
    sums_G = torch.zeros_like(values_N).index_add_(0, seg_N, live_vals_N)
    counts_G = torch.zeros_like(values_N).index_add_(0, seg_N, live_N.to(values_N.dtype))
    return sums_G[seg_N], counts_G[seg_N]


def seq_log_ratio(log_ratio_N: torch.Tensor, seq_ids_N: torch.Tensor, live_N: torch.Tensor,
                  kind: str) -> torch.Tensor:
    """log rho of each row's sequence ("product": the sum, "geometric": the mean), unclamped."""
    sums_N, counts_N = segment_sum_count(log_ratio_N, seq_ids_N, live_N)
    if kind == "product":
        return sums_N
    if kind == "geometric":
        return sums_N / counts_N.clamp_min(1.0)
    raise ValueError(f"seq_ratio must be 'product' or 'geometric', got {kind!r}")


def within(values_N: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """lo <= v <= hi per row (the MIS keep rule; bounds inclusive)."""
    return (values_N >= lo) & (values_N <= hi)


def opsm_keep(adv_N: torch.Tensor, log_ratio_N: torch.Tensor, seq_ids_N: torch.Tensor,
              live_N: torch.Tensor, delta: float) -> torch.Tensor:
    """OPSM keep-mask: False where A < 0 and the sequence's mean log(mu / pi) exceeds delta."""
    kl_N = -seq_log_ratio(log_ratio_N, seq_ids_N, live_N, "geometric")
    return ~((adv_N < 0) & (kl_N > delta))


def num_sequences(seq_ids_N: torch.Tensor, live_N: torch.Tensor) -> torch.Tensor:
    """Distinct seq ids among live rows, on device (sort-based; no host sync)."""
    if not seq_ids_N.numel():
        return torch.zeros((), dtype=torch.int64, device=seq_ids_N.device)
    keyed_N = torch.where(live_N, seq_ids_N.long(), -1)
    sorted_N = torch.sort(keyed_N).values
    starts_N = torch.ones_like(sorted_N, dtype=torch.bool)
    starts_N[1:] = sorted_N[1:] != sorted_N[:-1]
    return (starts_N & (sorted_N >= 0)).sum()
