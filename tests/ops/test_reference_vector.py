"""The docs/math.md §8.3 float64 vector and the §3.2 disagreement example, through the op.

Expected values are copied from the spec table (10 significant digits); tolerance 1e-9.
"""

import math

import torch

import megatron_pdm as pdm
from megatron_pdm.ops.reference import reference_token_stats
from megatron_pdm.ops.stats import exp_shift, is_sampled_slot, log_sums
from megatron_pdm.parallel.shards import shard_info
from megatron_pdm.parallel.shard_math import (
    mask_columns,
    masked_columns,
    pack_sums,
    shard_tail_max,
    shard_tail_sums,
)

Z_PI = torch.tensor([[2.0, 1.5, 0.3, -0.5, 1.0, 0.2, -1.0, -2.0]], dtype=torch.float64)
Z_MU = torch.tensor([[2.2, 1.2, 0.4, -0.4, 0.9, 0.0, -1.2, -1.5]], dtype=torch.float64)
IDS = torch.tensor([[0, 1, 4, 5]])
K = torch.tensor([5])


def _stats():
    logmu = torch.log_softmax(Z_MU, -1)
    valid = torch.ones(1, 4, dtype=torch.bool)
    return pdm.token_stats(Z_PI, K, IDS, logmu.gather(1, IDS), valid, tp_group=None,
                           vocab_size=None), logmu


def test_section_8_3_vector():
    st, logmu = _stats()
    pi = torch.softmax(Z_PI, -1)[0]
    mu = logmu.exp()[0]
    expected = {
        "p2": 0.2573688585,
        "mu_tail": 0.1452836339,
        "pi_tail": 0.1346250477,
        "q_tail": 0.0070212412,
        "binary_tv": 0.0127730201,
        "binary_kl": 0.0013933548,
        "topk_tv": 0.0942934306,
        "topk_kl": 0.0204164763,
    }
    for name, value in expected.items():
        assert abs(getattr(st, name).item() - value) < 1e-9, name
    assert abs(math.exp(st.logprob.item() - math.log(mu[5].item())) - 1.2361885031) < 1e-9
    assert abs((pi**3).sum().item() - 0.0849544155) < 1e-9
    # Full TV / full KL of the spec (all of mu known here).
    assert abs(0.5 * (pi - mu).abs().sum().item() - 0.0981405903) < 1e-9
    assert abs((mu * (mu.log() - pi.log())).sum().item() - 0.0220670346) < 1e-9
    rates = {
        "aggregated": 0.0287037639,
        "uniform": 0.0276275794,
        "exact": 0.0278247396,
    }
    for tail, value in rates.items():
        assert abs(st.divergence_rate("kl", tail).item() - value) < 1e-9, tail
    assert abs(st.divergence_rate("tv", "exact").item() - 0.0678898148) < 1e-9
    full_kl_rate = (pi[5] - mu[5]) + (pi * (mu - pi)).sum()
    assert abs(full_kl_rate.item() - 0.0278291918) < 1e-9
    # §7.2: the certified interval contains the true full-KL rate.
    lower, upper = st.direction_interval()
    assert lower.item() <= full_kl_rate.item() <= upper.item()
    assert not bool(st.direction_uncertain)
    # vT H v (§7.4) from the op's P2 and the exact P3.
    pk, p2, p3 = pi[5], st.p2[0], (pi**3).sum()
    assert abs((pk - 2 * pk**2 + p3 - (pk - p2) ** 2).item() - 0.1065722430) < 1e-9


def test_section_8_3_tp2_simulation():
    """Shards {0..3}, {4..7}: per-shard partials reduced by hand reproduce log pi_S and P2."""
    logmu = torch.log_softmax(Z_MU, -1)
    valid = torch.ones(1, 4, dtype=torch.bool)
    shards = [shard_info(r, 2, 4, 8) for r in range(2)]
    parts = [Z_PI[:, r * 4:(r + 1) * 4].clone() for r in range(2)]
    cols = [masked_columns(p, K, IDS, valid, s) for p, s in zip(parts, shards)]
    for p, c in zip(parts, cols):
        mask_columns(p, c)
    tail_max = torch.maximum(*[shard_tail_max(p, 1.0, torch.float64) for p in parts])
    sums = sum(pack_sums(c, shard_tail_sums(p, exp_shift(tail_max), 1.0), 1.0)
               for p, c in zip(parts, cols))
    is_k = is_sampled_slot(IDS, valid, K)
    ls = log_sums(tail_max, sums[:, :4], sums[:, 4], sums[:, 5], sums[:, 6], valid, is_k)
    logpi_s = ls.support_rel - ls.log_z[:, None]
    expected = torch.tensor([-0.9052622285, -1.4052622285, -1.9052622285, -2.7052622285])
    # Spec lists log pi_S in ascending z order: ids 0, 1, 4, 5 have z 2.0, 1.5, 1.0, 0.2.
    assert torch.allclose(logpi_s[0], expected.double(), atol=1e-9)
    p2 = torch.exp(ls.log_s2_not_k - 2 * ls.log_z) + torch.exp(2 * (ls.sampled_rel - ls.log_z))
    assert abs(p2.item() - 0.2573688585) < 1e-9
    ref = reference_token_stats(Z_PI, K, IDS, logmu.gather(1, IDS), valid)
    assert torch.allclose(logpi_s, ref["support_logprobs"], atol=1e-12)


def test_section_3_2_disagreement_example():
    """mu = (0.70, 0.05, 0.25), pi = (0.80, 0.06, 0.14), k = 1: r = 1.2, KL = 0.0424,
    Ddot = (0.06 - 0.05) + [0.8*(-0.1) + 0.06*(-0.01) + 0.14*0.11] = 0.01 - 0.0652 = -0.0552.
    With A > 0 and delta < KL, DPPO (ratio direction) masks; PDM keeps the token."""
    pi = torch.tensor([[0.80, 0.06, 0.14]], dtype=torch.float64)
    mu = torch.tensor([[0.70, 0.05, 0.25]], dtype=torch.float64)
    ids = torch.tensor([[0, 1, 2]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    st = pdm.token_stats(pi.log(), torch.tensor([1]), ids, mu.log(), valid, tp_group=None,
                         vocab_size=None)
    assert abs(st.topk_kl.item() - 0.0424) < 1e-4
    for tail in ("aggregated", "uniform", "exact"):  # empty tail: all estimators agree
        assert abs(st.divergence_rate("kl", tail).item() + 0.0552) < 1e-12
    args = (st, torch.tensor([1.0]), mu[:, 1].log().float(), torch.tensor([True]))
    dppo = pdm.PolicyLossConfig(proximity="topk_kl", direction="ratio", delta_low=0.04,
                                delta_high=0.04)
    pdm_cfg = pdm.PolicyLossConfig(proximity="topk_kl", direction="predictive", delta_low=0.04,
                                   delta_high=0.04)
    assert pdm.policy_loss(*args, dppo).mask.tolist() == [False]
    out = pdm.policy_loss(*args, pdm_cfg)
    assert out.mask.tolist() == [True]
    assert out.metrics["pdm/direction_disagree_frac"].tolist() == [1.0, 1.0]
