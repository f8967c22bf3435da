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

Cancellation (§6): with pi_k -> 1 the textbook forms subtract nearly equal numbers:
1 - 2 pi_k + P2, P2 - pi_k^2 and pi_k - P2 lose every digit in fp32 once 1 - pi_k < ~3e-4. The
op provides the exact complements 1 - pi_k (= e^{log Z_-k - log Z}) and Q = sum_{j != k} pi_j^2
(`p2_not_k`), and every formula here is written with them:
    1 - 2 pi_k + P2 = (1 - pi_k)^2 + Q        c = pi_k - P2 = pi_k (1 - pi_k) - Q

§7.2 certified interval for the *full* KL direction: with L = local + retained - Q_T the true
Ddot lies in [L, L + min(pi_T mu_max_T, mu_T pi_max_T)]; if the interval straddles 0 the sign is
uncertain. mu_max_T is bounded by the smallest behavior probability in the engine's top-K.

Shape legend: N tokens, S support slots. Invalid slots must carry pi = mu = 0.
"""

from __future__ import annotations

import torch

__all__ = [
    "TAIL_ESTIMATORS",
    "binary_kl_rate",
    "binary_tv_rate",
    "kl_certified_interval",
    "kl_rate",
    "tv_rate_terms",
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
    *,
    one_m_pi_k_N: torch.Tensor | None = None,
    p2_not_k_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ddot for the Top-K TV away from ties, and the tie part (§3.6).

    Args:
        one_m_pi_k_N: exact 1 - pi_k (default: computed as 1 - pi_k).
        p2_not_k_N: exact sum_{j != k} pi_j^2 for "exact" (default: the support part without
            k plus Q_T).
        Others: as `kl_rate`; is_k_NS marks the slot of the sampled token.

    Returns:
        (ddot_N, tie_N): ddot_N = 0.5 [sum_{non-tie} s_i rho_i + s_T rho_T];
        tie_N = 0.5 sum_{ties} |rho_i| (>= 0). The one-sided change along the actual step
        sign(A) v is proportional to sign(A) * ddot_N + tie_N.
    """
    _check_tail(tail)
    one_m_N = 1.0 - pi_k_N if one_m_pi_k_N is None else one_m_pi_k_N
    # sum_{i in S, i != k} pi_i^2: the support part of P2 without the sampled token
    sq_others_N = torch.where(is_k_NS, 0.0, pi_NS * pi_NS).sum(-1)
    if tail == "exact":
        q_N = q_tail_N
        q_not_k_N = sq_others_N + q_N if p2_not_k_N is None else p2_not_k_N
    else:
        if tail == "aggregated":
            q_N = pi_tail_N * pi_tail_N
        else:
            q_N = pi_tail_N * pi_tail_N / n_tail_N.clamp_min(1.0)
        q_not_k_N = sq_others_N + q_N
    # c = pi_k - P2 = pi_k (1 - pi_k) - sum_{j != k} pi_j^2, without the pi_k - P2 cancellation
    c_N = pi_k_N * one_m_N - q_not_k_N
    # rho_k = pi_k ((1 - pi_k) - c), rho_i = pi_i (-pi_i - c) for i != k
    rho_NS = pi_NS * (torch.where(is_k_NS, one_m_N[:, None], -pi_NS) - c_N[:, None])
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
    pi_k_N: torch.Tensor, mu_k_N: torch.Tensor, one_m_pi_k_N: torch.Tensor,
    p2_not_k_N: torch.Tensor,
) -> torch.Tensor:
    """Exact Ddot of the Binary KL: (pi_k - mu_k) [(1 - pi_k) + Q / (1 - pi_k)] (§3.5).

    Args:
        one_m_pi_k_N: exact 1 - pi_k (TokenStats.one_minus_pi_k).
        p2_not_k_N: Q = sum_{j != k} pi_j^2, exact (TokenStats.p2_not_k), not P2 - pi_k^2.

    The bracket is positive for pi_k < 1, so sign(Ddot) == sign(r - 1).
    """
    live = one_m_pi_k_N > 0
    frac_N = torch.where(live, p2_not_k_N / torch.where(live, one_m_pi_k_N, 1.0), 0.0)
    return (pi_k_N - mu_k_N) * (one_m_pi_k_N + frac_N)


def binary_tv_rate(
    pi_k_N: torch.Tensor, mu_k_N: torch.Tensor, one_m_pi_k_N: torch.Tensor,
    p2_not_k_N: torch.Tensor,
) -> torch.Tensor:
    """Ddot of |pi_k - mu_k|: sign(pi_k - mu_k) * pi_k * ||e_k - pi||^2 (§3.5), with
    ||e_k - pi||^2 = (1 - pi_k)^2 + sum_{j != k} pi_j^2 from the exact complements (both terms
    positive: no cancellation, unlike 1 - 2 pi_k + P2)."""
    return torch.sign(pi_k_N - mu_k_N) * pi_k_N * (one_m_pi_k_N * one_m_pi_k_N + p2_not_k_N)


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
