"""TokenStats: every per-token quantity the trust-region family needs, from a handful of sums.

The vocab-parallel op (parallel/vocab_parallel.py) reduces each logits row to a few numbers: the
tail max t (over the columns outside the support and the sampled token), the support logits z_S,
the sampled logit z_k, and the exact tail sums Z_T = sum_{j not in S+k} e^{z_j - t} and
S2_T = sum e^{2(z_j - t)}. `log_sums` combines them in log space, relative to t (§5.1, §6.10):

    log Z_-k = logsumexp(log Z_T, z_i - t for i in S, i != k)        (everything but k)
    log Z    = logaddexp(log Z_-k, z_k - t)
    log S2_-k = logsumexp(log S2_T, 2 (z_i - t) for i in S, i != k)

so no sum underflows (Z_T >= 1 when the tail is not empty) and nothing overflows (e^{z_k - t}
is never formed): log(1 - pi_k) = log Z_-k - log Z is exact however close pi_k is to 1, and
P2 = pi_k^2 + S2_-k / Z^2 keeps the part without k exactly (`p2_not_k`).
`assemble_token_stats` turns those into probabilities and divergences, and `TokenStats` carries
them with the estimator methods of ops/direction.py. Everything here is detached except `logprob`.

Precision: stats are kept in the op's working dtype (fp32, or fp64 for fp64 logits). The behavior
tail mass mu_T is accumulated in fp64 and clamped (§6.1); pi_T and Q_T are exact masked sums (no
1 - sum cancellation); log(1 - pi_k) = log Z_{-k} - log Z (§7.3).

-inf logits (§6.10) are tokens the policy cannot emit: they add nothing to any sum. A valid
support slot or a sampled token with pi = 0 gives D_K = +inf / log pi_k = -inf here (the exact
values); `policy_loss` refuses them on loss rows.

Shape legend: N tokens, S support slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm.ops import direction as _direction
from megatron_pdm.ops import divergence as _div

__all__ = [
    "LogSums",
    "TokenStats",
    "assemble_token_stats",
    "exp_shift",
    "is_sampled_slot",
    "log_sums",
]


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
        log1m_pi_k: exact log(1 - pi_k) = log Z_{-k} - log Z (-inf only when pi_k = 1 exactly).
        log1m_mu_k: log(1 - mu_k) via log1mexp.
        pi_tail, mu_tail: tail masses outside the valid support (pi exact, mu fp64-clamped);
            pi_tail = 1 on rows without support (the whole vocabulary is tail).
        q_tail: Q_T = sum_{j in tail} pi_j^2 (exact).
        p2: P2 = sum_j pi_j^2.
        p2_not_k: sum_{j != k} pi_j^2, exact (no P2 - pi_k^2 cancellation when pi_k -> 1).
        pi_max_tail: max_{j in tail} pi_j (0 if the tail is empty).
        mu_max_tail_bound: upper bound of max_{j in tail} mu_j: the smallest valid behavior
            probability on the support excluding the sampled token (1 if none), §7.2.
        n_tail: engine vocab size minus the number of valid support slots (float).
        topk_kl, topk_tv: Top-K(+tail) divergences; 0 on rows without support.
        binary_kl, binary_tv: divergences of the split {k, not k}; 0 on rows without support.
        vocab_size: engine vocabulary size used for the softmax and the uniform tail.
        support_ids: [N, S] the support ids (as given; for error messages and tools).
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
    p2_not_k: torch.Tensor
    pi_max_tail: torch.Tensor
    mu_max_tail_bound: torch.Tensor
    n_tail: torch.Tensor
    topk_kl: torch.Tensor
    topk_tv: torch.Tensor
    binary_kl: torch.Tensor
    binary_tv: torch.Tensor
    vocab_size: int
    support_ids: torch.Tensor | None = None

    @property
    def support_probs(self) -> torch.Tensor:
        """[N, S] pi on the support, 0 on invalid slots."""
        return torch.where(self.support_valid, self.support_logprobs.exp(), 0.0)

    @property
    def behavior_support_probs(self) -> torch.Tensor:
        """[N, S] mu on the support, 0 on invalid slots."""
        return torch.where(self.support_valid, self.behavior_support_logprobs.exp(), 0.0)

    @property
    def one_minus_pi_k(self) -> torch.Tensor:
        """[N] 1 - pi_k from the exact complement (no cancellation near pi_k = 1)."""
        return self.log1m_pi_k.exp()

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
            one_m_pi_k_N=self.one_minus_pi_k, p2_not_k_N=self.p2_not_k,
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


@dataclass
class LogSums:
    """Log-space normalizers of one batch ([N] each, [N, S] where noted), all relative to the
    row maximum `ref`, so every relative value is <= 0 and exp(-log_z) lies in [1/V, 1].

    Attributes:
        ref: the row max m = max(tail max, valid z_S, z_k) of the tempered logits (0 where every
            logit is -inf; NaN / +inf are kept and make the row non-finite).
        tail_rel: tail max - ref (-inf when the tail has no finite logit).
        support_rel: [N, S] z_S - ref; sampled_rel: z_k - ref.
        log_z: log Z; log_z_not_k: log Z_{-k}; log_tail: log Z_T (tail outside S and k);
        log_tail2: log S2_T; log_s2_not_k: log sum_{j != k} e^{2(z_j - ref)}.
    """

    ref: torch.Tensor
    tail_rel: torch.Tensor
    support_rel: torch.Tensor
    sampled_rel: torch.Tensor
    log_z: torch.Tensor
    log_z_not_k: torch.Tensor
    log_tail: torch.Tensor
    log_tail2: torch.Tensor
    log_s2_not_k: torch.Tensor


def exp_shift(tail_max_N: torch.Tensor) -> torch.Tensor:
    """The shift of the op's exp pass over the tail: the tail max, or 0 where it is -inf (no
    finite tail logit: every term is then e^-inf = 0 whatever the shift, and -inf - (-inf) is
    never formed). NaN and +inf are kept (validation reports the row)."""
    return torch.where(tail_max_N == -torch.inf, 0.0, tail_max_N)


def log_sums(
    tail_max_N: torch.Tensor,
    support_logits_NS: torch.Tensor,
    sampled_logit_N: torch.Tensor,
    tail_sum_exp_N: torch.Tensor,
    tail_sum_exp2_N: torch.Tensor,
    support_valid_NS: torch.Tensor,
    is_sampled_NS: torch.Tensor,
) -> LogSums:
    """Combines the reduced sums in log space (see the module docstring; §5.1, §7.3).

    Args:
        tail_max_N: global max of the tempered logits outside S and k (-inf if none).
        support_logits_NS, sampled_logit_N: tempered logits at the support and sampled ids.
        tail_sum_exp_N, tail_sum_exp2_N: Z_T and S2_T relative to `exp_shift(tail_max_N)`.
        support_valid_NS, is_sampled_NS: which slots are live, which holds k.
    """
    live_NS = torch.where(support_valid_NS, support_logits_NS, -torch.inf)
    top_N = torch.maximum(tail_max_N, sampled_logit_N)
    if live_NS.shape[1]:
        top_N = torch.maximum(top_N, live_NS.amax(-1))
    ref_N = torch.where(top_N == -torch.inf, 0.0, top_N)
    shift_rel_N = exp_shift(tail_max_N) - ref_N
    tail_rel_N = tail_max_N - ref_N
    support_rel_NS = support_logits_NS - ref_N[:, None]
    sampled_rel_N = sampled_logit_N - ref_N
    others_NS = support_valid_NS & ~is_sampled_NS
    rel_other_NS = torch.where(others_NS, support_rel_NS, -torch.inf)
    # Z_T >= 1 when the tail is not empty (its max contributes e^0); log 0 = -inf otherwise
    # (shift_rel is finite: the shift is 0 where the tail max is -inf, ref is never -inf).
    log_tail_N = torch.log(tail_sum_exp_N) + shift_rel_N
    log_tail2_N = torch.log(tail_sum_exp2_N) + 2.0 * shift_rel_N
    log_z_not_k_N = torch.logsumexp(torch.cat([log_tail_N[:, None], rel_other_NS], 1), -1)
    log_s2_not_k_N = torch.logsumexp(torch.cat([log_tail2_N[:, None], 2.0 * rel_other_NS], 1),
                                     -1)
    log_z_N = torch.logaddexp(log_z_not_k_N, sampled_rel_N)
    return LogSums(ref_N, tail_rel_N, support_rel_NS, sampled_rel_N, log_z_N, log_z_not_k_N,
                   log_tail_N, log_tail2_N, log_s2_not_k_N)


def is_sampled_slot(support_ids_NS: torch.Tensor, support_valid_NS: torch.Tensor,
                    sampled_ids_N: torch.Tensor) -> torch.Tensor:
    """[N, S] bool: the valid slot(s) holding the sampled token."""
    return support_valid_NS & (support_ids_NS.long() == sampled_ids_N.long()[:, None])


def assemble_token_stats(
    logprob_N: torch.Tensor,
    ls: LogSums,
    *,
    support_logprobs_NS: torch.Tensor,
    support_valid_NS: torch.Tensor,
    support_ids_NS: torch.Tensor,
    is_sampled_NS: torch.Tensor,
    vocab_size: int,
) -> TokenStats:
    """Builds TokenStats from the globally reduced quantities, combined by `log_sums`.

    Args:
        logprob_N: log pi_k (may carry grad).
        ls: `log_sums` of the reduced tail max, support and sampled logits and tail sums (the
            op's forward computed them already; nothing is recomputed here).
        support_logprobs_NS, support_valid_NS, support_ids_NS: op inputs.
        is_sampled_NS: `is_sampled_slot` of the op inputs (the one `ls` was built with).
        vocab_size: engine vocabulary size.

    Returns:
        TokenStats in the dtype of `ls`.
    """
    dtype = ls.ref.dtype
    valid = support_valid_NS
    is_k_NS = is_sampled_NS
    has_support = valid.any(-1)
    logpi_NS = torch.where(valid, ls.support_rel - ls.log_z[:, None], -torch.inf)
    logmu_NS = torch.where(valid, support_logprobs_NS.to(dtype), -torch.inf)
    logpi_k = logprob_N.detach().to(dtype)
    logmu_k = torch.where(is_k_NS, logmu_NS, 0.0).sum(-1)
    logmu_k = torch.where(is_k_NS.any(-1), logmu_k, -torch.inf)
    # Tail = outside the valid support. With a support, k is in it and the tail is exactly the
    # columns the op summed; without one, the tail is the whole vocabulary.
    log_pi_tail = torch.where(has_support, ls.log_tail - ls.log_z, 0.0)
    pi_tail = log_pi_tail.exp()
    mu_tail = _div.tail_mass(support_logprobs_NS, valid, dtype)
    log1m_pi_k = ls.log_z_not_k - ls.log_z
    pi_k = logpi_k.exp()
    p2_not_k = torch.exp(ls.log_s2_not_k - 2.0 * ls.log_z)
    p2 = p2_not_k + pi_k * pi_k
    q_tail = torch.where(has_support, torch.exp(ls.log_tail2 - 2.0 * ls.log_z), p2)
    tail_max_rel = torch.where(has_support, ls.tail_rel,
                               torch.maximum(ls.tail_rel, ls.sampled_rel))
    mu_NS = torch.where(valid, logmu_NS.exp(), 0.0)
    others = valid & ~is_k_NS
    mu_bound = torch.where(others, mu_NS, torch.inf).amin(-1) if valid.shape[-1] else None
    mu_bound = (
        torch.where(torch.isfinite(mu_bound), mu_bound, 1.0)
        if mu_bound is not None
        else torch.ones_like(ls.ref)
    )
    pi_NS = torch.where(valid, logpi_NS.exp(), 0.0)
    topk_kl = _div.topk_kl(logpi_NS, logmu_NS, valid, pi_tail, mu_tail, log_pi_tail_N=log_pi_tail)
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
        pi_k=pi_k,
        mu_k=torch.where(has_support, logmu_k.exp(), 0.0),
        log1m_pi_k=log1m_pi_k,
        log1m_mu_k=_div.log1mexp(logmu_k),
        pi_tail=pi_tail,
        mu_tail=mu_tail,
        q_tail=q_tail,
        p2=p2,
        p2_not_k=p2_not_k,
        pi_max_tail=torch.exp(tail_max_rel - ls.log_z),
        mu_max_tail_bound=mu_bound,
        n_tail=(vocab_size - valid.sum(-1)).to(dtype),
        topk_kl=topk_kl,
        topk_tv=topk_tv,
        binary_kl=torch.where(has_support, bin_kl, 0.0),
        binary_tv=torch.where(has_support, bin_tv, 0.0),
        vocab_size=int(vocab_size),
        support_ids=support_ids_NS,
    )
