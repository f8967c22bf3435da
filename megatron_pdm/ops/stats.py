"""TokenStats: every per-token quantity the trust-region family needs, from a handful of sums.

The vocab-parallel op (parallel/vocab_parallel.py) reduces each logits row to a few numbers: the
global row max m, Z = sum e^{z-m}, the support logits z_S, the sampled logit z_k, S2 = sum
e^{2(z-m)}, the exact tail sums sum_{j not in S} e^{z-m} and e^{2(z-m)}, Z_{-k} and the tail max.
`assemble_token_stats` turns those into probabilities and divergences, and `TokenStats` carries
them with the estimator methods of ops/direction.py. Everything here is detached except `logprob`.

Precision: stats are kept in the op's working dtype (fp32, or fp64 for fp64 logits). The behavior
tail mass mu_T is accumulated in fp64 and clamped (§6.1); pi_T and Q_T are exact masked sums (no
1 - sum cancellation); log(1 - pi_k) = log Z_{-k} - log Z (§7.3).

Shape legend: N tokens, S support slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm.ops import direction as _direction
from megatron_pdm.ops import divergence as _div

__all__ = ["TokenStats", "assemble_token_stats"]


@dataclass
class TokenStats:
    """Per-token statistics of pi (training) against mu (rollout). All [N] unless noted.

    Attributes:
        logprob: log pi_k of the sampled token; the ONLY differentiable field.
        support_logprobs: [N, S] log pi on the support, -inf on invalid slots (detached).
        behavior_support_logprobs: [N, S] log mu on the support, -inf on invalid slots.
        support_valid: [N, S] bool.
        is_sampled: [N, S] bool, the (unique) valid slot holding the sampled token.
        has_support: bool, rows with at least one valid slot.
        pi_k, mu_k: sampled-token probabilities (mu_k from the support slot; 0 without support).
        log1m_pi_k: exact log(1 - pi_k) = log Z_{-k} - log Z.
        log1m_mu_k: log(1 - mu_k) via log1mexp.
        pi_tail, mu_tail: tail masses outside the valid support (pi exact, mu fp64-clamped).
        q_tail: Q_T = sum_{j in tail} pi_j^2 (exact).
        p2: P2 = sum_j pi_j^2.
        pi_max_tail: max_{j in tail} pi_j (0 if the tail is empty).
        mu_max_tail_bound: upper bound of max_{j in tail} mu_j: the smallest valid behavior
            probability on the support excluding the sampled token (1 if none), §7.2.
        n_tail: engine vocab size minus the number of valid support slots (float).
        topk_kl, topk_tv: Top-K(+tail) divergences; 0 on rows without support.
        binary_kl, binary_tv: divergences of the split {k, not k}; 0 on rows without support.
        vocab_size: engine vocabulary size used for the softmax and the uniform tail.
    """

    logprob: torch.Tensor
    support_logprobs: torch.Tensor
    behavior_support_logprobs: torch.Tensor
    support_valid: torch.Tensor
    is_sampled: torch.Tensor
    has_support: torch.Tensor
    pi_k: torch.Tensor
    mu_k: torch.Tensor
    log1m_pi_k: torch.Tensor
    log1m_mu_k: torch.Tensor
    pi_tail: torch.Tensor
    mu_tail: torch.Tensor
    q_tail: torch.Tensor
    p2: torch.Tensor
    pi_max_tail: torch.Tensor
    mu_max_tail_bound: torch.Tensor
    n_tail: torch.Tensor
    topk_kl: torch.Tensor
    topk_tv: torch.Tensor
    binary_kl: torch.Tensor
    binary_tv: torch.Tensor
    vocab_size: int

    @property
    def support_probs(self) -> torch.Tensor:
        """[N, S] pi on the support, 0 on invalid slots."""
        return torch.where(self.support_valid, self.support_logprobs.exp(), 0.0)

    @property
    def behavior_support_probs(self) -> torch.Tensor:
        """[N, S] mu on the support, 0 on invalid slots."""
        return torch.where(self.support_valid, self.behavior_support_logprobs.exp(), 0.0)

    def divergence_rate(self, kind: str = "kl", tail: str = "aggregated") -> torch.Tensor:
        """Ddot of the Top-K divergence along v = e_k - pi (§3.2, §3.3, §3.6, §7.1).

        Args:
            kind: "kl" (Top-K KL) or "tv" (Top-K TV, away from ties; see `tv_tie_rate`).
            tail: "aggregated" | "uniform" | "exact". For "kl", "exact" is the exact derivative
                of D_K (§7.1); for "tv", "exact" uses the exact P2 and Q_T (§3.6).

        Returns:
            [N] Ddot (0 on rows without support).
        """
        if kind == "kl":
            out = _direction.kl_rate(
                self.pi_k, self.mu_k, self.support_probs, self.behavior_support_probs,
                self.pi_tail, self.mu_tail, self.q_tail, self.n_tail, tail,
            )
        elif kind == "tv":
            out, _ = self._tv_terms(tail)
        else:
            raise ValueError(f"kind must be 'kl' or 'tv', got {kind!r}")
        return torch.where(self.has_support, out, 0.0)

    def tv_tie_rate(self, tail: str = "exact") -> torch.Tensor:
        """[N] 0.5 * sum of |rho| over exact ties pi_i == mu_i (§3.6 one-sided rule)."""
        _, tie = self._tv_terms(tail)
        return torch.where(self.has_support, tie, 0.0)

    def _tv_terms(self, tail: str) -> tuple[torch.Tensor, torch.Tensor]:
        return _direction.tv_rate_terms(
            self.pi_k, self.is_sampled, self.support_probs, self.behavior_support_probs,
            self.support_valid, self.pi_tail, self.mu_tail, self.q_tail, self.n_tail, tail,
        )

    def direction_interval(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lower [N], upper [N]) certified bounds of the full-KL Ddot (§7.2)."""
        return _direction.kl_certified_interval(
            self.pi_k, self.mu_k, self.support_probs, self.behavior_support_probs,
            self.pi_tail, self.mu_tail, self.q_tail, self.pi_max_tail, self.mu_max_tail_bound,
        )

    @property
    def direction_uncertain(self) -> torch.Tensor:
        """[N] bool: the §7.2 interval straddles 0 (sign of the full-KL Ddot not certified)."""
        lower, upper = self.direction_interval()
        return self.has_support & (lower <= 0) & (upper >= 0)


def assemble_token_stats(
    logprob_N: torch.Tensor,
    row_max_N: torch.Tensor,
    tail_max_N: torch.Tensor,
    support_logits_NS: torch.Tensor,
    sum_exp_N: torch.Tensor,
    sum_exp2_N: torch.Tensor,
    tail_sum_exp_N: torch.Tensor,
    tail_sum_exp2_N: torch.Tensor,
    sum_exp_not_k_N: torch.Tensor,
    support_logprobs_NS: torch.Tensor,
    support_valid_NS: torch.Tensor,
    support_ids_NS: torch.Tensor,
    sampled_ids_N: torch.Tensor,
    vocab_size: int,
) -> TokenStats:
    """Builds TokenStats from the globally reduced sums (tempered logits, shifted by the row max).

    Args:
        logprob_N: log pi_k (may carry grad).
        row_max_N, tail_max_N: global max of the tempered logits, over all / over the tail.
        support_logits_NS: tempered logits at the support ids (any value on invalid slots).
        sum_exp_N, sum_exp2_N: Z and S2 relative to row_max.
        tail_sum_exp_N, tail_sum_exp2_N: the same sums over the tail only.
        sum_exp_not_k_N: Z_{-k}.
        support_logprobs_NS, support_valid_NS, support_ids_NS, sampled_ids_N: op inputs.
        vocab_size: engine vocabulary size.

    Returns:
        TokenStats in the dtype of `row_max_N`.
    """
    dtype = row_max_N.dtype
    valid = support_valid_NS
    log_z = torch.log(sum_exp_N)
    shift_N = row_max_N + log_z
    logpi_NS = torch.where(valid, support_logits_NS - shift_N[:, None], -torch.inf)
    logmu_NS = torch.where(valid, support_logprobs_NS.to(dtype), -torch.inf)
    is_k_NS = valid & (support_ids_NS.long() == sampled_ids_N.long()[:, None])
    has_support = valid.any(-1)
    logpi_k = logprob_N.detach().to(dtype)
    logmu_k = torch.where(is_k_NS, logmu_NS, 0.0).sum(-1)
    logmu_k = torch.where(is_k_NS.any(-1), logmu_k, -torch.inf)
    z2 = sum_exp_N * sum_exp_N
    pi_tail = tail_sum_exp_N / sum_exp_N
    mu_tail = _div.tail_mass(support_logprobs_NS, valid, dtype)
    log1m_pi_k = torch.log(sum_exp_not_k_N) - log_z
    mu_NS = torch.where(valid, logmu_NS.exp(), 0.0)
    others = valid & ~is_k_NS
    mu_bound = torch.where(others, mu_NS, torch.inf).amin(-1) if valid.shape[-1] else None
    mu_bound = (
        torch.where(torch.isfinite(mu_bound), mu_bound, 1.0)
        if mu_bound is not None
        else torch.ones_like(row_max_N)
    )
    pi_NS = torch.where(valid, logpi_NS.exp(), 0.0)
    topk_kl = _div.topk_kl(logpi_NS, logmu_NS, valid, pi_tail, mu_tail)
    topk_kl = torch.where(has_support, topk_kl, 0.0)
    topk_tv = torch.where(has_support, _div.topk_tv(pi_NS, mu_NS, valid, pi_tail, mu_tail), 0.0)
    safe_logmu_k = torch.where(has_support, logmu_k, 0.0)
    bin_kl = _div.binary_kl(logpi_k, log1m_pi_k, safe_logmu_k)
    bin_tv = _div.binary_tv(logpi_k, safe_logmu_k)
    return TokenStats(
        logprob=logprob_N,
        support_logprobs=logpi_NS,
        behavior_support_logprobs=logmu_NS,
        support_valid=valid,
        is_sampled=is_k_NS,
        has_support=has_support,
        pi_k=logpi_k.exp(),
        mu_k=torch.where(has_support, logmu_k.exp(), 0.0),
        log1m_pi_k=log1m_pi_k,
        log1m_mu_k=_div.log1mexp(logmu_k),
        pi_tail=pi_tail,
        mu_tail=mu_tail,
        q_tail=tail_sum_exp2_N / z2,
        p2=sum_exp2_N / z2,
        pi_max_tail=torch.exp(tail_max_N - row_max_N - log_z),
        mu_max_tail_bound=mu_bound,
        n_tail=(vocab_size - valid.sum(-1)).to(dtype),
        topk_kl=topk_kl,
        topk_tv=topk_tv,
        binary_kl=torch.where(has_support, bin_kl, 0.0),
        binary_tv=torch.where(has_support, bin_tv, 0.0),
        vocab_size=int(vocab_size),
    )
