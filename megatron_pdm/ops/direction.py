"""Predicted direction of the divergence: Ddot = d/deta D(softmax(z + eta v)) at eta = 0.

PDM (docs/math.md §3) keeps DPPO's proximity test D > delta but replaces PPO's direction test
sign(A (r - 1)) by the sign of the first-order change of the *same* divergence D along the
token's own policy-gradient step. In the free-logit idealization one ascent step on A * r moves the
logits by eta * A * r * v with v = e_k - pi, so sign(Delta D) = sign(A * Ddot) (§3.2). For any
D(pi(z)) with logit gradient g, Ddot = g_k - E_{j~pi}[g_j].

KL (§3.2, §3.3, §7.1):
    Ddot = (pi_k - mu_k) + sum_{i in S} pi_i (mu_i - pi_i) + tau
with the tail term tau estimated three ways:
    aggregated  pi_T (mu_T - pi_T)                 (PDM paper: the tail as one token)
    uniform     pi_T (mu_T - pi_T) / (n - m)       (PDM paper: tail spread over n - m tokens)
    exact       (mu_T - pi_T) Q_T / pi_T           (the exact derivative of D_K itself, §7.1)
The three share the sign of (mu_T - pi_T) and are ordered uniform <= exact <= aggregated in
magnitude because Q_T / pi_T lies in [pi_T / (n - m), pi_T].

TV (§3.6): with c = pi_k - P2, rho_i = pi_i (1[i=k] - pi_i - c), rho_T = -Q_T - pi_T c,
    Ddot_TV = 0.5 [sum_S s_i rho_i + s_T rho_T],  s = sign(pi - mu).
"exact" uses the training side's exact P2 and Q_T; "aggregated" uses Q_T ~ pi_T^2 and
"uniform" Q_T ~ pi_T^2 / (n - m) (P2 then follows as sum_S pi_i^2 + Q_T). Ties (pi_i == mu_i)
get the one-sided rule of §3.6: moving away from equality always increases TV, so the tie part
|rho_i| is returned separately and the mask adds it regardless of the advantage sign.

Binary (§3.5): the same formulas with S = {k}; their sign equals sign(r - 1) (tested).

§7.2 certified interval for the *full* KL direction: with L = local + retained - Q_T the true
Ddot lies in [L, L + min(pi_T mu_max_T, mu_T pi_max_T)]; if the interval straddles 0 the sign is
uncertain. mu_max_T is bounded by the smallest behavior probability in the engine's top-K.

Shape legend: N tokens, S support slots. Invalid slots must carry pi = mu = 0.
"""

from __future__ import annotations

import torch

__all__ = [
    "TAIL_ESTIMATORS",
    "kl_rate",
    "tv_rate_terms",
    "binary_kl_rate",
    "binary_tv_rate",
    "kl_certified_interval",
]

TAIL_ESTIMATORS = ("aggregated", "uniform", "exact")


def _check_tail(tail: str) -> None:
    if tail not in TAIL_ESTIMATORS:
        raise ValueError(f"tail must be one of {TAIL_ESTIMATORS}, got {tail!r}")


def kl_rate(
    pi_k_N: torch.Tensor,
    mu_k_N: torch.Tensor,
    pi_NS: torch.Tensor,
    mu_NS: torch.Tensor,
    pi_tail_N: torch.Tensor,
    mu_tail_N: torch.Tensor,
    q_tail_N: torch.Tensor,
    n_tail_N: torch.Tensor,
    tail: str,
) -> torch.Tensor:
    """Ddot for the Top-K KL: local + retained + tail estimator (§3.3, §7.1).

    Args:
        pi_k_N, mu_k_N: sampled-token probabilities.
        pi_NS, mu_NS: support probabilities, 0 on invalid slots.
        pi_tail_N, mu_tail_N: tail masses.
        q_tail_N: exact Q_T = sum_{j in T} pi_j^2 (used by "exact").
        n_tail_N: number of tail tokens n - m (engine vocab minus valid support size).
        tail: "aggregated" | "uniform" | "exact".

    Returns:
        [N] Ddot.
    """
    _check_tail(tail)
    local_N = pi_k_N - mu_k_N
    retained_N = (pi_NS * (mu_NS - pi_NS)).sum(-1)
    diff_N = mu_tail_N - pi_tail_N
    if tail == "aggregated":
        tau_N = pi_tail_N * diff_N
    elif tail == "uniform":
        tau_N = pi_tail_N * diff_N / n_tail_N.clamp_min(1.0)
    else:
        live = pi_tail_N > 0
        tau_N = torch.where(live, diff_N * q_tail_N / torch.where(live, pi_tail_N, 1.0), 0.0)
    return local_N + retained_N + tau_N


def tv_rate_terms(
    pi_k_N: torch.Tensor,
    is_k_NS: torch.Tensor,
    pi_NS: torch.Tensor,
    mu_NS: torch.Tensor,
    valid_NS: torch.Tensor,
    pi_tail_N: torch.Tensor,
    mu_tail_N: torch.Tensor,
    q_tail_N: torch.Tensor,
    n_tail_N: torch.Tensor,
    tail: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ddot for the Top-K TV away from ties, and the tie part (§3.6).

    Returns:
        (ddot_N, tie_N): ddot_N = 0.5 [sum_{non-tie} s_i rho_i + s_T rho_T];
        tie_N = 0.5 sum_{ties} |rho_i| (>= 0). The one-sided change along the actual step
        sign(A) v is proportional to sign(A) * ddot_N + tie_N.
    """
    _check_tail(tail)
    sq_support_N = (pi_NS * pi_NS).sum(-1)
    if tail == "exact":
        q_N = q_tail_N
    elif tail == "aggregated":
        q_N = pi_tail_N * pi_tail_N
    else:
        q_N = pi_tail_N * pi_tail_N / n_tail_N.clamp_min(1.0)
    c_N = pi_k_N - (sq_support_N + q_N)
    rho_NS = pi_NS * (is_k_NS.to(pi_NS.dtype) - pi_NS - c_N[:, None])
    rho_t_N = -q_N - pi_tail_N * c_N
    s_NS = torch.where(valid_NS, torch.sign(pi_NS - mu_NS), 0.0)
    s_t_N = torch.sign(pi_tail_N - mu_tail_N)
    tie_NS = valid_NS & (pi_NS == mu_NS)
    tie_t_N = pi_tail_N == mu_tail_N
    ddot_N = 0.5 * ((s_NS * rho_NS).sum(-1) + s_t_N * rho_t_N)
    tie_N = 0.5 * (
        torch.where(tie_NS, rho_NS.abs(), 0.0).sum(-1) + torch.where(tie_t_N, rho_t_N.abs(), 0.0)
    )
    return ddot_N, tie_N


def binary_kl_rate(
    pi_k_N: torch.Tensor, mu_k_N: torch.Tensor, one_m_pi_k_N: torch.Tensor, p2_N: torch.Tensor
) -> torch.Tensor:
    """Exact Ddot of the Binary KL: (pi_k - mu_k) [(1 - pi_k) + Q / (1 - pi_k)], Q = P2 - pi_k^2.

    The bracket is positive for pi_k < 1, so sign(Ddot) == sign(r - 1) (§3.5).
    """
    q_N = (p2_N - pi_k_N * pi_k_N).clamp_min(0.0)
    live = one_m_pi_k_N > 0
    frac_N = torch.where(live, q_N / torch.where(live, one_m_pi_k_N, 1.0), 0.0)
    return (pi_k_N - mu_k_N) * (one_m_pi_k_N + frac_N)


def binary_tv_rate(pi_k_N: torch.Tensor, mu_k_N: torch.Tensor, p2_N: torch.Tensor) -> torch.Tensor:
    """Ddot of |pi_k - mu_k|: sign(pi_k - mu_k) * pi_k * ||e_k - pi||^2 (§3.5)."""
    return torch.sign(pi_k_N - mu_k_N) * pi_k_N * (1.0 - 2.0 * pi_k_N + p2_N)


def kl_certified_interval(
    pi_k_N: torch.Tensor,
    mu_k_N: torch.Tensor,
    pi_NS: torch.Tensor,
    mu_NS: torch.Tensor,
    pi_tail_N: torch.Tensor,
    mu_tail_N: torch.Tensor,
    q_tail_N: torch.Tensor,
    pi_max_tail_N: torch.Tensor,
    mu_max_tail_bound_N: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Certified bounds on the full-vocabulary KL Ddot (§7.2).

    The unknown cross term X = sum_T pi_j mu_j obeys 0 <= X <= min(pi_T mu_max_T, mu_T pi_max_T).

    Returns:
        (lower_N, upper_N) with lower = local + retained - Q_T.
    """
    local_N = pi_k_N - mu_k_N
    retained_N = (pi_NS * (mu_NS - pi_NS)).sum(-1)
    lower_N = local_N + retained_N - q_tail_N
    width_N = torch.minimum(pi_tail_N * mu_max_tail_bound_N, mu_tail_N * pi_max_tail_N)
    return lower_N, lower_N + width_N
