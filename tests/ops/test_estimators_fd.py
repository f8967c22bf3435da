"""Every Ddot's exact part vs float64 finite differences of D(softmax(z + eta v)), v = e_k - pi.

Central differences with eta = 1e-6 have truncation error ~eta^2 and rounding ~1e-16/eta, so
agreement to 1e-8 (absolute, on O(0.1) quantities) checks the closed forms of §3.2, §3.5, §3.6
and §7.1. Also: the estimator ordering uniform <= exact <= aggregated (§3.3) and the binary
equivalence sign(Ddot_binary) == sign(r - 1) (§3.5) on random cases.
"""

import torch

import megatron_pdm as pdm
from megatron_pdm.ops import direction

ETA = 1e-6


def _random_row(seed, n=12, k_top=4):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64) * 1.5
    logmu = torch.log_softmax(z + 0.7 * torch.randn(n, generator=g, dtype=torch.float64), -1)
    k = int(torch.multinomial(logmu.exp(), 1, generator=g))
    top = logmu.topk(k_top).indices.tolist()
    ids = top + ([k] if k not in top else [])
    return z, logmu, k, torch.tensor(ids)


def _topk_kl(z, logmu, ids):
    logpi = torch.log_softmax(z, -1)
    mu_s, lp_s = logmu[ids].exp(), logpi[ids]
    mu_t = 1 - mu_s.sum()
    pi_t = 1 - logpi[ids].exp().sum()
    return (mu_s * (logmu[ids] - lp_s)).sum() + mu_t * (mu_t.log() - pi_t.log())


def _topk_tv(z, logmu, ids):
    pi = torch.softmax(z, -1)
    mu_s, pi_s = logmu[ids].exp(), pi[ids]
    return 0.5 * ((mu_s - pi_s).abs().sum() + ((1 - mu_s.sum()) - (1 - pi_s.sum())).abs())


def _full_kl(z, logmu):
    return (logmu.exp() * (logmu - torch.log_softmax(z, -1))).sum()


def _fd(fn, z, k):
    pi = torch.softmax(z, -1)
    v = -pi.clone()
    v[k] += 1.0
    return (fn(z + ETA * v) - fn(z - ETA * v)) / (2 * ETA)


def _stats(z, logmu, k, ids):
    return pdm.token_stats(
        z[None], torch.tensor([k]), ids[None], logmu[ids][None],
        torch.ones(1, len(ids), dtype=torch.bool), tp_group=None, vocab_size=None,
    )


def test_exact_kl_estimator_is_derivative_of_topk_kl():
    for seed in range(20):
        z, logmu, k, ids = _random_row(seed)
        st = _stats(z, logmu, k, ids)
        fd = _fd(lambda zz: _topk_kl(zz, logmu, ids), z, k)
        assert abs(st.divergence_rate("kl", "exact").item() - fd.item()) < 1e-8, seed


def test_full_kl_identity():
    """With the whole vocabulary as support (empty tail) Ddot = (pi_k - mu_k) + <pi, mu - pi>."""
    for seed in range(10):
        z, logmu, k, _ = _random_row(seed, n=9)
        ids = torch.arange(9)
        st = _stats(z, logmu, k, ids)
        fd = _fd(lambda zz: _full_kl(zz, logmu), z, k)
        for tail in ("aggregated", "uniform", "exact"):
            assert abs(st.divergence_rate("kl", tail).item() - fd.item()) < 1e-8


def test_tv_exact_p2_is_derivative_of_topk_tv():
    for seed in range(20):
        z, logmu, k, ids = _random_row(seed)
        st = _stats(z, logmu, k, ids)
        fd = _fd(lambda zz: _topk_tv(zz, logmu, ids), z, k)
        assert abs(st.divergence_rate("tv", "exact").item() - fd.item()) < 1e-8, seed
        assert st.tv_tie_rate("exact").item() == 0.0


def test_binary_rates_are_derivatives():
    for seed in range(10):
        z, logmu, k, ids = _random_row(seed)
        st = _stats(z, logmu, k, ids)
        mu_k = logmu[k].exp()

        def bin_kl(zz):
            p = torch.softmax(zz, -1)[k]
            return mu_k * (mu_k / p).log() + (1 - mu_k) * ((1 - mu_k) / (1 - p)).log()

        def bin_tv(zz):
            return (torch.softmax(zz, -1)[k] - mu_k).abs()

        kl_rate = direction.binary_kl_rate(st.pi_k, st.mu_k, st.one_minus_pi_k, st.p2_not_k)
        tv_rate = direction.binary_tv_rate(st.pi_k, st.mu_k, st.one_minus_pi_k, st.p2_not_k)
        assert abs(kl_rate.item() - _fd(bin_kl, z, k).item()) < 1e-8
        assert abs(tv_rate.item() - _fd(bin_tv, z, k).item()) < 1e-8


def test_estimator_ordering_and_sign():
    for seed in range(30):
        z, logmu, k, ids = _random_row(seed, n=40, k_top=3)
        st = _stats(z, logmu, k, ids)
        base = st.pi_k - st.mu_k + (st.support_probs * (st.behavior_support_probs
                                                         - st.support_probs)).sum(-1)
        tails = {t: (st.divergence_rate("kl", t) - base).item() for t in
                 ("aggregated", "uniform", "exact")}
        assert abs(tails["uniform"]) <= abs(tails["exact"]) + 1e-15
        assert abs(tails["exact"]) <= abs(tails["aggregated"]) + 1e-15
        signs = {torch.sign(torch.tensor(v)).item() for v in tails.values()}
        assert len(signs) == 1


def test_binary_equivalence_random():
    """sign(Ddot_binary) == sign(r - 1) for both binary divergences (§3.5)."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(500, 30, generator=g, dtype=torch.float64) * 2
    k = torch.randint(0, 30, (500,), generator=g)
    pi = torch.softmax(z, -1)
    pi_k = pi.gather(1, k[:, None]).squeeze(1)
    mu_k = torch.rand(500, generator=g, dtype=torch.float64).clamp(1e-4, 1 - 1e-4)
    q = (pi**2).sum(-1) - pi_k**2  # sum_{j != k} pi_j^2 (fp64, moderate pi_k: no cancellation)
    r = pi_k / mu_k
    assert torch.equal(torch.sign(direction.binary_kl_rate(pi_k, mu_k, 1 - pi_k, q)),
                       torch.sign(r - 1))
    assert torch.equal(torch.sign(direction.binary_tv_rate(pi_k, mu_k, 1 - pi_k, q)),
                       torch.sign(r - 1))
