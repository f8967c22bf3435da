"""Top-K(+tail) and binary divergences between the rollout policy mu and the training policy pi.

DPPO (docs/math.md §2.3) replaces PPO's ratio test |r - 1| > eps with a divergence between the
behavior policy mu (the rollout engine, which sampled the token) and the training policy pi. The
engine only returns log mu on a small support S = TopK(mu) + {sampled token}, so the divergence is
taken between two distributions over |S| + 1 buckets: every support token, plus one "tail" bucket
holding the remaining mass. Both the Top-K TV and the Top-K KL are lower bounds of the true
full-vocabulary divergences (triangle / log-sum inequality, §2.3).

The Binary variants collapse the support to the sampled token k: buckets {k, not k}. They need no
top-K data at all, only log pi_k, log mu_k and an accurate log(1 - p) for both policies.

Numerical traps handled here (docs/math.md §6):
  * mu_T = 1 - sum_S mu_i subtracts nearly equal numbers: accumulate in fp64, clamp to [0, 1].
  * 0 * log 0 = 0: every mu log mu term is guarded with `where(mu > 0, ...)`.
  * log(1 - mu_k) uses log1mexp (no `+ 1e-8` bias near mu_k -> 1); log(1 - pi_k) is passed in
    exactly (log Z_{-k} - log Z, §7.3) by the caller.
  * pi_T = 0 exactly (no tail mass the policy can emit) is replaced by the dtype's `tiny`
    before its log: mu_T is only known to ~1e-7, so a +inf from its rounding noise would mask
    every such token (§6.1, §6.10). The same holds for the {not k} bucket of the binary KL when
    pi_k = 1 exactly. Any other value, however small, is used exactly (in log space).

All functions are pure, elementwise over tokens, and valid on any device and float dtype.

Shape legend: N tokens, S support slots (top-K plus the sampled token, invalid slots ignored).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "binary_kl",
    "binary_tv",
    "log1mexp",
    "tail_mass",
    "topk_kl",
    "topk_tv",
]


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """Computes log(1 - exp(x)) for x <= 0 without cancellation (Maechler's rule, §6.2).

    Args:
        x: log-probabilities, any shape. Values > 0 are clamped to 0 (result -inf).

    Returns:
        log(1 - exp(x)), same shape and dtype.
    """
    x = x.clamp_max(0.0)
    return torch.where(
        x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x))
    )


def tail_mass(
    logprobs_NS: torch.Tensor, valid_NS: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Mass outside the valid support, 1 - sum_S exp(logprob), accumulated in fp64 and clamped.

    Args:
        logprobs_NS: log-probabilities on the support (any float dtype).
        valid_NS: bool, which slots count.
        dtype: dtype of the returned tensor.

    Returns:
        [N] tail mass in [0, 1].
    """
    probs_NS = torch.where(valid_NS, logprobs_NS.double().exp(), 0.0)
    return (1.0 - probs_NS.sum(-1)).clamp(0.0, 1.0).to(dtype)


def _xlogy_ratio(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """p * (log p - log q) with 0 where p == 0 (and no NaN from -inf logs)."""
    live = p > 0
    safe_logp = torch.where(live, logp, 0.0)
    safe_logq = torch.where(live, logq, 0.0)
    return torch.where(live, p * (safe_logp - safe_logq), 0.0)


def _log_bucket(log_p: torch.Tensor) -> torch.Tensor:
    """log of a bucket mass for a KL term: exact, except log 0 -> log(tiny) (module docstring)."""
    return torch.where(log_p == -torch.inf, math.log(torch.finfo(log_p.dtype).tiny), log_p)


def topk_kl(
    logpi_NS: torch.Tensor,
    logmu_NS: torch.Tensor,
    valid_NS: torch.Tensor,
    pi_tail_N: torch.Tensor,
    mu_tail_N: torch.Tensor,
    *,
    log_pi_tail_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-K forward KL(mu || pi) over support buckets plus one tail bucket (§2.3).

    D_K = sum_{i in S} mu_i log(mu_i / pi_i) + mu_T log(mu_T / pi_T).

    Args:
        logpi_NS: training log-probabilities on the support.
        logmu_NS: behavior log-probabilities on the support.
        valid_NS: bool mask of live slots.
        pi_tail_N: training tail mass (exact masked sum preferred, §7.3).
        mu_tail_N: behavior tail mass (fp64-accumulated, clamped).
        log_pi_tail_N: log pi_T when known in log space (the op's exact log Z_T - log Z, which
            stays exact where pi_T itself underflows); default log(pi_tail_N).

    Returns:
        [N] D_K (0 on rows without support and zero tail difference). A valid slot with
        pi_i = 0 (a -inf training logit) gives +inf, the exact value (§6.10).
    """
    mu_NS = torch.where(valid_NS, logmu_NS.exp(), 0.0)
    support_N = _xlogy_ratio(mu_NS, logmu_NS, logpi_NS).sum(-1)
    tiny = torch.finfo(pi_tail_N.dtype).tiny
    log_mu_t = torch.log(mu_tail_N.clamp_min(tiny))
    log_pi_t = _log_bucket(torch.log(pi_tail_N) if log_pi_tail_N is None else log_pi_tail_N)
    return support_N + _xlogy_ratio(mu_tail_N, log_mu_t, log_pi_t)


def topk_tv(
    pi_NS: torch.Tensor,
    mu_NS: torch.Tensor,
    valid_NS: torch.Tensor,
    pi_tail_N: torch.Tensor,
    mu_tail_N: torch.Tensor,
) -> torch.Tensor:
    """Top-K total variation: 0.5 * (sum_S |mu_i - pi_i| + |mu_T - pi_T|) (§2.3).

    Returns:
        [N] TV_K in [0, 1].
    """
    diff_NS = torch.where(valid_NS, (mu_NS - pi_NS).abs(), 0.0)
    return 0.5 * (diff_NS.sum(-1) + (mu_tail_N - pi_tail_N).abs())


def binary_kl(
    logpi_k_N: torch.Tensor, log1m_pi_k_N: torch.Tensor, logmu_k_N: torch.Tensor
) -> torch.Tensor:
    """Bernoulli forward KL(mu || pi) of the split {k, not k} (§2.3, §6.2).

    Args:
        logpi_k_N: log pi_k.
        log1m_pi_k_N: exact log(1 - pi_k) (log Z_{-k} - log Z from the op); -inf (pi_k = 1
            exactly) is replaced by log(tiny), like an empty tail bucket (module docstring).
        logmu_k_N: log mu_k; log(1 - mu_k) is computed with log1mexp.

    Returns:
        [N] binary KL.
    """
    mu_k = logmu_k_N.exp()
    log1m_mu_k = log1mexp(logmu_k_N)
    return _xlogy_ratio(mu_k, logmu_k_N, logpi_k_N) + _xlogy_ratio(
        -torch.expm1(logmu_k_N.clamp_max(0.0)), log1m_mu_k, _log_bucket(log1m_pi_k_N)
    )


def binary_tv(logpi_k_N: torch.Tensor, logmu_k_N: torch.Tensor) -> torch.Tensor:
    """Binary TV |pi_k - mu_k| (§2.3). Its sign(pi_k - mu_k) equals sign(r - 1)."""
    return (logpi_k_N.exp() - logmu_k_N.exp()).abs()
