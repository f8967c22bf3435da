"""The op and the loss at the edges: -inf logits, extreme logit gaps, thresholds in the
statistics' dtype, exact complements in the binary-TV rate, padding seq ids, the vocab_size type.

Every test names the value it expects and where it comes from (a float64 oracle or a closed
form); each one failed on the code before commit bf18be2.
"""

import math

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.ops.reference import reference_token_stats

NEG_INF = -math.inf


def _one_row(z, k, ids, logmu, *, dtype=torch.float32, valid=None):
    """token_stats of one row (full vocabulary on one device)."""
    ids_t = torch.tensor([ids])
    valid_t = torch.ones_like(ids_t, dtype=torch.bool) if valid is None else torch.tensor([valid])
    return pdm.token_stats(
        torch.tensor([z], dtype=dtype), torch.tensor([k]), ids_t,
        torch.tensor([logmu], dtype=torch.float32), valid_t, tp_group=None, vocab_size=None,
    )


def _mu_row(v, ids, k, spread=0.3):
    """A behaviour distribution on the ids (tail mass `spread`), log mu on the ids."""
    p = torch.full((len(ids),), (1.0 - spread) / len(ids), dtype=torch.float64)
    return p.log().tolist(), float(p[ids.index(k)])


# -- -inf logits (docs/math.md §6.10) ----------------------------------------------------------


@pytest.mark.parametrize("adv", [0.0, 1.0, -1.0])
def test_neg_inf_sampled_logit_on_loss_row_is_an_error_naming_the_row(adv):
    """log pi_k = -inf on a loss row: the surrogate is undefined, for any A (§6.10)."""
    z = torch.randn(3, 50).tolist()
    z[1][7] = NEG_INF
    ids = [[7, 3, 4], [7, 3, 4], [7, 3, 4]]
    logmu = torch.log(torch.tensor([[0.3, 0.2, 0.1]] * 3))
    st = pdm.token_stats(torch.tensor(z), torch.tensor([7, 7, 7]), torch.tensor(ids), logmu,
                         torch.ones(3, 3, dtype=torch.bool), tp_group=None, vocab_size=None)
    cfg = pdm.PolicyLossConfig.preset("grpo")
    adv_n = torch.tensor([1.0, adv, 1.0])
    beh = logmu[:, 0]
    with pytest.raises(ValueError, match=r"row 1.*-inf"):
        pdm.policy_loss(st, adv_n, beh, torch.tensor([True, True, True]), cfg)
    # Outside the loss mask the value is allowed and ignored: a finite loss.
    out = pdm.policy_loss(st, adv_n, beh, torch.tensor([True, False, True]), cfg)
    assert torch.isfinite(out.loss_sum)


def test_neg_inf_sampled_logit_unchecked_gives_no_nan():
    """With the checks off (a validated batch) an A = 0 row adds exactly 0, never NaN, and the
    gradient is finite whatever A is; an A != 0 row gives the infinite loss the math gives."""
    z = torch.randn(2, 30)
    z[:, 5] = NEG_INF
    logits = z.clone().requires_grad_()
    ids = torch.tensor([[5, 1], [5, 1]])
    logmu = torch.log(torch.tensor([[0.4, 0.3], [0.4, 0.3]]))
    st = pdm.token_stats(logits, torch.tensor([5, 5]), ids, logmu,
                         torch.ones(2, 2, dtype=torch.bool), validate=False,
                         tp_group=None, vocab_size=None)
    cfg = pdm.PolicyLossConfig.preset("dppo-binary-tv")
    lm = torch.tensor([True, False])
    out = pdm.policy_loss(st, torch.tensor([0.0, 1.0]), logmu[:, 0], lm, cfg, check_inputs=False)
    assert out.loss_sum.item() == 0.0
    out.loss_sum.backward()
    assert torch.isfinite(logits.grad).all()


def test_neg_inf_logit_on_other_support_id_is_an_error_naming_row_and_slot():
    """A valid support id (mu_i > 0) the training policy cannot emit: D_K = +inf is no number a
    threshold can use; on a loss row it is an input error naming row and slot (§6.10)."""
    z = torch.randn(2, 40)
    z[1, 9] = NEG_INF
    ids = torch.tensor([[3, 9, 12], [3, 9, 12]])
    logmu = torch.log(torch.tensor([[0.5, 0.2, 0.1]] * 2))
    st = pdm.token_stats(z, torch.tensor([3, 3]), ids, logmu, torch.ones(2, 3, dtype=torch.bool),
                         tp_group=None, vocab_size=None)
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    with pytest.raises(ValueError, match=r"row 1, slot 1.*-inf"):
        pdm.policy_loss(st, torch.ones(2), logmu[:, 0], torch.tensor([True, True]), cfg)
    out = pdm.policy_loss(st, torch.ones(2), logmu[:, 0], torch.tensor([True, False]), cfg)
    assert torch.isfinite(out.loss_sum)
    assert all(torch.isfinite(v).all() for v in out.metrics.values())


def test_neg_inf_tail_logits_are_tokens_the_policy_cannot_emit():
    """-inf in the tail (a banned token) adds nothing to any sum: every statistic equals the
    float64 oracle on the same logits, finite, and pi of that token is 0 in the gradient."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 60, generator=g, dtype=torch.float64)
    z[:, 40:50] = NEG_INF
    z[2, :] = NEG_INF  # one row: only the support and the sampled token are emittable
    z[2, [0, 1, 2, 5]] = torch.tensor([1.0, 0.5, -0.5, 0.2], dtype=torch.float64)
    ids = torch.tensor([[0, 1, 2, 5]] * 4)
    logmu = torch.log(torch.tensor([[0.4, 0.3, 0.1, 0.05]] * 4)).float()
    valid = torch.ones(4, 4, dtype=torch.bool)
    k = torch.tensor([0, 1, 5, 2])
    logits = z.clone().requires_grad_()
    st = pdm.token_stats(logits, k, ids, logmu, valid, tp_group=None, vocab_size=None)
    ref = reference_token_stats(z, k, ids, logmu, valid)
    # Row 2 has pi_T = 0 with mu_T = 0.15: its tail bucket keeps the tiny clamp of §6.1.
    tiny = torch.finfo(torch.float64).tiny
    mu_s = logmu[2].double().exp()
    mu_t = 1.0 - mu_s.sum()
    ref["topk_kl"][2] = (mu_s * (mu_s.log() - ref["support_logprobs"][2])).sum() + mu_t * (
        mu_t.log() - math.log(tiny))
    for name in ("logprob", "pi_tail", "q_tail", "p2", "topk_kl", "topk_tv", "binary_kl",
                 "log1m_pi_k", "pi_max_tail"):
        got = getattr(st, name).detach()
        assert torch.isfinite(got).all(), name
        assert torch.allclose(got, ref[name], atol=1e-12), name
    st.logprob.sum().backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[:, 40:50] == 0).all()


def test_sampled_token_alone_binary_kl_is_finite():
    """Every other token -inf (pi_k = 1 exactly), mu_k < 1: the not-k bucket is a tail bucket and
    keeps the tiny clamp of §6.1 (like pi_T = 0), so binary_kl is finite; log(1 - pi_k) = -inf."""
    z = [NEG_INF] * 10
    z[4] = 0.0
    st = _one_row(z, 4, [4], [math.log(0.9)])
    assert st.log1m_pi_k.item() == NEG_INF
    tiny = torch.finfo(torch.float32).tiny
    expected = 0.9 * math.log(0.9) + 0.1 * (math.log(0.1) - math.log(tiny))
    assert math.isfinite(st.binary_kl.item())
    assert abs(st.binary_kl.item() - expected) < 1e-4


# -- an extreme logit gap (finite fp32) --------------------------------------------------------


@pytest.mark.parametrize("gap", [104.0, 120.0, 300.0])
def test_dominant_sampled_logit_keeps_exact_complement(gap):
    """z_k is `gap` above every other (finite) logit: log(1 - pi_k) = log((V-1) e^-gap) - log(1 +
    (V-1) e^-gap), about -gap + log(V-1); binary KL against mu_k = 0.5 is then finite (~gap/2)."""
    v = 64
    z = [0.0] * v
    z[0] = gap
    st = _one_row(z, 0, [0, 1], [math.log(0.5), math.log(0.01)])
    lse_rest = math.log(v - 1) - gap  # log sum_{j != k} e^{z_j - z_k}
    exact_log1m = lse_rest - math.log1p(math.exp(lse_rest))
    assert abs(st.log1m_pi_k.item() - exact_log1m) < 1e-4 * abs(exact_log1m)
    # KL(Bern(0.5) || Bern(pi_k)), pi_k rounds to 1: 0.5 log 0.5 + 0.5 (log 0.5 - log(1 - pi_k))
    expected = 0.5 * math.log(0.5) + 0.5 * (math.log(0.5) - exact_log1m)
    assert abs(st.binary_kl.item() - expected) < 1e-4 * expected
    # the slot-1 log-prob and the tail mass are exact in log space as well
    assert abs(st.support_logprobs[0, 1].item() - (-gap - math.log1p(math.exp(lse_rest)))) < 1e-3


# -- thresholds in the statistics' dtype -------------------------------------------------------


def _f64_row(pi, mu, k):
    n = len(pi)
    return pdm.token_stats(
        torch.tensor([pi], dtype=torch.float64).log(), torch.tensor([k]), torch.arange(n)[None],
        torch.tensor([mu], dtype=torch.float64).log(), torch.ones(1, n, dtype=torch.bool),
        tp_group=None, vocab_size=None)


def test_binary_tv_threshold_is_exact_in_float64():
    """D = |pi_k - mu_k| = 0.15 + 3e-9 > delta = 0.15 exactly: masked (A > 0, pi > mu).
    A float32 delta (0.15000000596) would keep it."""
    mu_k = 0.4
    pi_k = mu_k + 0.15 + 3e-9
    st = _f64_row([pi_k, 1 - pi_k], [mu_k, 1 - mu_k], 0)
    cfg = pdm.PolicyLossConfig.preset("dppo-binary-tv")
    out = pdm.policy_loss(st, torch.tensor([1.0], dtype=torch.float64),
                          torch.tensor([math.log(mu_k)], dtype=torch.float64),
                          torch.tensor([True]), cfg)
    assert out.divergence.dtype == torch.float64 and out.divergence.item() > 0.15
    assert out.mask.tolist() == [False]


def test_grpo_epsilon_is_exact_in_float64():
    """r = 1.28 + 5e-10 > 1 + eps_high (0.28 in float64, 0.2800000012 in float32): clipped."""
    mu_k = 0.5
    pi_k = mu_k * (1.28 + 5e-10)
    st = _f64_row([pi_k, 1 - pi_k], [mu_k, 1 - mu_k], 0)
    out = pdm.policy_loss(st, torch.tensor([1.0], dtype=torch.float64),
                          torch.tensor([math.log(mu_k)], dtype=torch.float64),
                          torch.tensor([True]), pdm.PolicyLossConfig.preset("grpo"))
    assert out.mask.tolist() == [False]


# -- the binary-TV rate from exact complements -------------------------------------------------


@pytest.mark.parametrize("one_minus", [3e-4, 1e-5, 1e-7])
def test_binary_tv_rate_near_certain_token_fp32(one_minus):
    """pi_k = 1 - eps spread over 100 other tokens, fp32 logits: the predictive binary-TV rate
    pi_k ((1 - pi_k)^2 + sum_{j!=k} pi_j^2) from the exact complements matches the float64
    oracle to 1e-3 relative, and its sign (pi_k > mu_k) survives."""
    v = 101
    other = math.log(one_minus / (v - 1))
    top = math.log1p(-one_minus)
    z = torch.full((1, v), other, dtype=torch.float64)
    z[0, 0] = top
    logits = z.float()
    mu_k = 0.9
    st = pdm.token_stats(logits, torch.tensor([0]), torch.tensor([[0]]),
                         torch.tensor([[math.log(mu_k)]]), torch.ones(1, 1, dtype=torch.bool),
                         tp_group=None, vocab_size=None)
    pi = torch.softmax(logits.double(), -1)[0]
    expected = pi[0] * ((1 - pi[0]) ** 2 + (pi[1:] ** 2).sum())
    cfg = pdm.PolicyLossConfig(proximity="binary_tv", direction="predictive", delta_low=1e-3,
                               delta_high=1e-3)
    out = pdm.policy_loss(st, torch.tensor([1.0]), torch.tensor([math.log(mu_k)]),
                          torch.tensor([True]), cfg)
    assert out.away_score.item() > 0
    assert abs(out.away_score.item() - expected.item()) < 1e-3 * expected.item()
    assert out.mask.tolist() == [False]  # out of region (|pi_k - mu_k| ~ 0.1) and moving away


# -- padding sequence ids on loss rows ---------------------------------------------------------


def test_padding_seq_id_on_loss_row():
    """seq_ids = -1 marks padding; on a loss row with a sequence aggregation it is an input error
    naming the row (checks on); with the checks off the row is padding: no loss, no count."""
    st = _f64_row([0.5, 0.3, 0.2], [0.4, 0.4, 0.2], 0)
    st3 = pdm.token_stats(torch.tensor([[0.5, 0.3, 0.2]] * 3, dtype=torch.float64).log(),
                          torch.tensor([0, 0, 0]), torch.arange(3).expand(3, 3),
                          torch.tensor([[0.4, 0.4, 0.2]] * 3, dtype=torch.float64).log(),
                          torch.ones(3, 3, dtype=torch.bool), tp_group=None, vocab_size=None)
    del st
    cfg = pdm.PolicyLossConfig.preset("dppo-binary-tv", aggregation="seq-mean-token-sum")
    args = (st3, torch.tensor([1.0, 1.0, 1.0]), torch.full((3,), math.log(0.4)),
            torch.tensor([True, True, True]), cfg)
    seq = torch.tensor([0, -1, 1])
    with pytest.raises(ValueError, match=r"seq_ids: row 1"):
        pdm.policy_loss(*args, seq_ids=seq)
    out = pdm.policy_loss(*args, seq_ids=seq, check_inputs=False)
    full = pdm.policy_loss(*args, seq_ids=torch.tensor([0, 2, 1]))
    assert out.num_tokens.item() == 2
    per_row = full.per_token_loss.detach()
    assert abs(out.loss_sum.item() - (per_row[0] + per_row[2]).item()) < 1e-12
    none = pdm.policy_loss(*args, seq_ids=torch.tensor([-1, -1, -1]), check_inputs=False)
    assert none.num_tokens.item() == 0 and none.loss_sum.item() == 0.0


# -- vocab_size must be an integer -------------------------------------------------------------


@pytest.mark.parametrize("bad", [45.0, 8.0, "45", True])
def test_vocab_size_must_be_an_int(bad):
    z = torch.randn(2, 45)
    ids = torch.tensor([[1, 2], [1, 2]])
    args = (z, torch.tensor([1, 1]), ids, torch.log(torch.tensor([[0.5, 0.2]] * 2)),
            torch.ones(2, 2, dtype=torch.bool))
    for validate in (True, False):
        with pytest.raises(TypeError, match=r"vocab_size must be an int"):
            pdm.token_stats(*args, vocab_size=bad, validate=validate, tp_group=None)
    pdm.token_stats(*args, vocab_size=45, tp_group=None)  # control


# -- tp_group and vocab_size are said, never assumed -------------------------------------------


def _one_row_args():
    z = torch.randn(2, 45)
    ids = torch.tensor([[1, 2], [1, 2]])
    return (z, torch.tensor([1, 1]), ids, torch.log(torch.tensor([[0.5, 0.2]] * 2)),
            torch.ones(2, 2, dtype=torch.bool))


@pytest.mark.parametrize("given", [{}, {"tp_group": None}, {"vocab_size": 45}])
def test_tp_group_and_vocab_size_have_no_default(given):
    """Leaving either out is a TypeError naming it: a shard silently normalised as if it were
    the whole vocabulary gives plausible, wrong statistics."""
    missing = [k for k in ("tp_group", "vocab_size") if k not in given]
    with pytest.raises(TypeError, match="|".join(missing)) as err:
        pdm.token_stats(*_one_row_args(), **given)
    for name in missing:
        assert name in str(err.value)
    pdm.token_stats(*_one_row_args(), tp_group=None, vocab_size=None)  # control: both said


def test_vocab_size_none_is_refused_on_a_shard(monkeypatch):
    """None means "no padding", which only a single device can vouch for (megatron pads the
    vocabulary it shards): on a 2-rank group the op asks for the engine vocabulary."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    group = object()
    with pytest.raises(ValueError, match=r"vocab_size=None on a vocab shard \(tp_group of 2"):
        pdm.token_stats(*_one_row_args(), tp_group=group, vocab_size=None)
    pdm.token_stats(*_one_row_args(), tp_group=group, vocab_size=90)  # control
