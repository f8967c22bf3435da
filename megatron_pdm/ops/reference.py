"""The naive full-vocabulary oracle for every test of the op and the estimators.

Deliberately unoptimized: cast the full logits to fp64, `log_softmax`, gather at the support,
and take every sum over explicit [N, V] tensors (tail sums by masking, complements by masked
sums, the TV rate from the full rho vector). It shares no code with the fused op or with
ops/direction.py except the three elementary divergence definitions, which are independently
checked against the docs/math.md §8.3 vector and by finite differences.

Use it only on small vocabularies: it materializes several fp64 [N, V] tensors.

Shape legend: N tokens, V vocabulary (real, unpadded), S support slots.
"""

from __future__ import annotations

import torch

__all__ = ["reference_token_stats", "reference_logprob"]


def reference_logprob(
    logits_NV: torch.Tensor, sampled_ids_N: torch.Tensor, *, vocab_size: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Differentiable fp64 log pi_k from full (possibly padded) logits."""
    v = logits_NV.shape[-1] if vocab_size is None else vocab_size
    logp_NV = torch.log_softmax(logits_NV[:, :v].double() / temperature, dim=-1)
    return logp_NV.gather(1, sampled_ids_N.long()[:, None]).squeeze(1)


def reference_token_stats(
    logits_NV: torch.Tensor,
    sampled_ids_N: torch.Tensor,
    support_ids_NS: torch.Tensor,
    support_logprobs_NS: torch.Tensor,
    support_valid_NS: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """All TokenStats quantities and every Ddot estimator, naively in fp64.

    Args:
        logits_NV: full logits (columns >= vocab_size are padding and dropped).
        sampled_ids_N, support_ids_NS, support_logprobs_NS, support_valid_NS: as token_stats.
        vocab_size: engine vocabulary; default all columns.
        temperature: logits are divided by it.

    Returns:
        dict of fp64 tensors: logprob, support_logprobs, pi_k, mu_k, log1m_pi_k, pi_tail, mu_tail,
        q_tail, p2, p2_not_k, pi_max_tail, topk_kl, topk_tv, binary_kl, binary_tv, full_kl,
        full_tv (only meaningful when mu is known on the full support), kl_rate_{aggregated,uniform,exact},
        tv_rate_{aggregated,uniform,exact}, interval_lower, interval_upper.
    """
    v = logits_NV.shape[-1] if vocab_size is None else vocab_size
    z_NV = logits_NV[:, :v].detach().double() / temperature
    logp_NV = torch.log_softmax(z_NV, dim=-1)
    pi_NV = logp_NV.exp()
    n = z_NV.shape[0]
    ids_NS = support_ids_NS.long()
    valid_NS = support_valid_NS
    k_N = sampled_ids_N.long()
    rows_N = torch.arange(n)

    in_s_NV = torch.zeros_like(pi_NV, dtype=torch.bool)
    for s in range(ids_NS.shape[1]):
        live = valid_NS[:, s]
        in_s_NV[rows_N[live], ids_NS[live, s]] = True
    tail_NV = ~in_s_NV
    onehot_NV = torch.zeros_like(pi_NV)
    onehot_NV[rows_N, k_N] = 1.0

    safe_ids_NS = torch.where(valid_NS, ids_NS, 0)
    logpi_NS = torch.where(valid_NS, logp_NV.gather(1, safe_ids_NS), -torch.inf)
    pi_NS = torch.where(valid_NS, logpi_NS.exp(), 0.0)
    logmu_NS = torch.where(valid_NS, support_logprobs_NS.double(), -torch.inf)
    mu_NS = torch.where(valid_NS, logmu_NS.exp(), 0.0)
    is_k_NS = valid_NS & (ids_NS == k_N[:, None])

    pi_k = pi_NV[rows_N, k_N]
    mu_k = (mu_NS * is_k_NS).sum(-1)
    pi_tail = (pi_NV * tail_NV).sum(-1)
    mu_tail = (1.0 - mu_NS.sum(-1)).clamp(0.0, 1.0)
    q_tail = (pi_NV**2 * tail_NV).sum(-1)
    p2 = (pi_NV**2).sum(-1)
    p2_not_k = (pi_NV**2 * (1.0 - onehot_NV)).sum(-1)
    pi_max_tail = torch.where(tail_NV, pi_NV, 0.0).amax(-1)
    log1m_pi_k = torch.log((pi_NV * (1.0 - onehot_NV)).sum(-1))

    def xlogy(p, lp, lq):
        live = p > 0
        return torch.where(live, p * (torch.where(live, lp, 0.0) - torch.where(live, lq, 0.0)), 0.0)

    topk_kl = xlogy(mu_NS, logmu_NS, logpi_NS).sum(-1) + xlogy(
        mu_tail, mu_tail.log(), pi_tail.log()
    )
    topk_tv = 0.5 * ((mu_NS - pi_NS).abs().sum(-1) + (mu_tail - pi_tail).abs())
    binary_kl = xlogy(mu_k, mu_k.log(), pi_k.log()) + xlogy(
        1.0 - mu_k, torch.log1p(-mu_k), log1m_pi_k
    )
    binary_tv = (pi_k - mu_k).abs()

    # KL rate: local + retained + tail estimators (§3.3, §7.1).
    local = pi_k - mu_k
    retained = (pi_NS * (mu_NS - pi_NS)).sum(-1)
    m_N = valid_NS.sum(-1).double()
    n_tail = v - m_N
    diff_t = mu_tail - pi_tail
    out = {}
    out["kl_rate_aggregated"] = local + retained + pi_tail * diff_t
    out["kl_rate_uniform"] = local + retained + pi_tail * diff_t / n_tail.clamp_min(1.0)
    out["kl_rate_exact"] = local + retained + torch.where(
        pi_tail > 0, diff_t * q_tail / pi_tail, 0.0
    )

    # TV rate from the full rho vector (§3.6), exact P2, and the two PDM approximations.
    for tail, q_hat in (
        ("exact", None),
        ("aggregated", pi_tail**2),
        ("uniform", pi_tail**2 / n_tail.clamp_min(1.0)),
    ):
        if q_hat is None:
            c = pi_k - p2
            rho_NV = pi_NV * (onehot_NV - pi_NV - c[:, None])
            rho_t = (rho_NV * tail_NV).sum(-1)
            rho_NS = torch.where(valid_NS, rho_NV.gather(1, torch.where(valid_NS, ids_NS, 0)), 0.0)
        else:
            c = pi_k - ((pi_NS**2).sum(-1) + q_hat)
            rho_NS = pi_NS * (is_k_NS.double() - pi_NS - c[:, None])
            rho_t = -q_hat - pi_tail * c
        s_NS = torch.where(valid_NS, torch.sign(pi_NS - mu_NS), 0.0)
        s_t = torch.sign(pi_tail - mu_tail)
        out[f"tv_rate_{tail}"] = 0.5 * ((s_NS * rho_NS).sum(-1) + s_t * rho_t)

    others = valid_NS & ~is_k_NS
    mu_bound = torch.where(others, mu_NS, torch.inf).amin(-1)
    mu_bound = torch.where(torch.isfinite(mu_bound), mu_bound, 1.0)
    lower = local + retained - q_tail
    out["interval_lower"] = lower
    out["interval_upper"] = lower + torch.minimum(pi_tail * mu_bound, mu_tail * pi_max_tail)
    out.update(
        logprob=logp_NV[rows_N, k_N],
        support_logprobs=logpi_NS,
        pi_k=pi_k,
        mu_k=mu_k,
        log1m_pi_k=log1m_pi_k,
        pi_tail=pi_tail,
        mu_tail=mu_tail,
        q_tail=q_tail,
        p2=p2,
        p2_not_k=p2_not_k,
        pi_max_tail=pi_max_tail,
        topk_kl=topk_kl,
        topk_tv=topk_tv,
        binary_kl=binary_kl,
        binary_tv=binary_tv,
    )
    return out
