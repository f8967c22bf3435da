"""policy_loss: hand-worked mask cases per preset, shaping, aggregation, metrics, gradients.

Cases use a 3-token vocabulary with the whole vocabulary as support (empty tail), so every
number below can be checked by hand; the derivations are in the comments.
"""

import math

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm import metrics as M


def _f64(*values):
    return torch.tensor(values, dtype=torch.float64)


def _stats(pi, mu, k):
    n = 3
    return pdm.token_stats(
        torch.tensor([pi], dtype=torch.float64).log(), torch.tensor([k]),
        torch.arange(n)[None], torch.tensor([mu], dtype=torch.float64).log(),
        torch.ones(1, n, dtype=torch.bool), tp_group=None, vocab_size=None,
    )


def _keep(preset, pi, mu, k, adv):
    st = _stats(pi, mu, k)
    out = pdm.policy_loss(st, torch.tensor([adv]), _f64(math.log(mu[k])),
                          torch.tensor([True]), pdm.PolicyLossConfig.preset(preset))
    return bool(out.mask[0])


# Shared disagreement case D: pi = (0.9, 0.08, 0.02), mu = (0.5, 0.06, 0.44), k = 1.
#   r = 0.08 / 0.06 = 1.333 (ratio says A > 0 moves away).
#   KL_K = 0.5 ln(0.5/0.9) + 0.06 ln(0.06/0.08) + 0.44 ln(0.44/0.02) = 1.0489 > 0.15.
#   Ddot_KL = (0.08 - 0.06) + [0.9(-0.4) + 0.08(-0.02) + 0.02(0.42)] = 0.02 - 0.3532 = -0.3332.
#   TV_K = 0.5 (0.4 + 0.02 + 0.42) = 0.42 > 0.2; P2 = 0.8168, c = 0.08 - 0.8168 = -0.7368,
#   rho = (0.9(-0.9 + 0.7368), 0.08(1 - 0.08 + 0.7368), 0.02(-0.02 + 0.7368))
#       = (-0.14688, 0.132544, 0.014336), s = (+, +, -): Ddot_TV = 0.5(-0.028672) = -0.014336.
#   So PDM keeps A > 0 (A Ddot < 0) and masks A < 0; DPPO does the opposite.
PI_D, MU_D, K_D = (0.9, 0.08, 0.02), (0.5, 0.06, 0.44), 1

CASES = [
    # GRPO (eps 0.2 / 0.28): r = 0.6/0.4 = 1.5 > 1.28 with A > 0 -> clipped; A < 0 moves r
    # toward 1 -> kept. r = 0.48/0.4 = 1.2 < 1.28 -> kept.
    # r = 0.3/0.4 = 0.75 < 0.8 with A < 0 -> clipped.
    ("grpo", (0.6, 0.3, 0.1), (0.4, 0.3, 0.3), 0, +1.0, False),
    ("grpo", (0.6, 0.3, 0.1), (0.4, 0.3, 0.3), 0, -1.0, True),
    ("grpo", (0.48, 0.42, 0.1), (0.4, 0.3, 0.3), 0, +1.0, True),
    ("grpo", (0.3, 0.5, 0.2), (0.4, 0.3, 0.3), 0, -1.0, False),
    # Binary-TV (0.15): |0.6 - 0.4| = 0.2 > 0.15, pi > mu -> masked for A > 0 only;
    # |0.5 - 0.4| = 0.1 inside; |0.2 - 0.4| = 0.2 with A < 0 -> masked.
    ("dppo-binary-tv", (0.6, 0.3, 0.1), (0.4, 0.3, 0.3), 0, +1.0, False),
    ("dppo-binary-tv", (0.6, 0.3, 0.1), (0.4, 0.3, 0.3), 0, -1.0, True),
    ("dppo-binary-tv", (0.5, 0.4, 0.1), (0.4, 0.3, 0.3), 0, +1.0, True),
    ("dppo-binary-tv", (0.2, 0.5, 0.3), (0.4, 0.3, 0.3), 0, -1.0, False),
    # Binary-KL (0.05): 0.4 ln(0.4/0.6) + 0.6 ln(0.6/0.4) = 0.0811 > 0.05 -> masked for A > 0;
    # 0.4 ln(0.4/0.45) + 0.6 ln(0.6/0.55) = 0.0051 < 0.05 -> kept.
    ("dppo-binary-kl", (0.6, 0.3, 0.1), (0.4, 0.3, 0.3), 0, +1.0, False),
    ("dppo-binary-kl", (0.6, 0.3, 0.1), (0.4, 0.3, 0.3), 0, -1.0, True),
    ("dppo-binary-kl", (0.45, 0.45, 0.1), (0.4, 0.3, 0.3), 0, +1.0, True),
    # TopK-TV (0.2): pi = (0.6, 0.3, 0.1), mu = (0.3, 0.4, 0.3): TV = 0.5(0.3 + 0.1 + 0.2) = 0.3;
    # k = 0 has r = 2 -> masked for A > 0, kept for A < 0. TV = 0.05 case (0.35,0.35,0.3) kept.
    ("dppo-topk-tv", (0.6, 0.3, 0.1), (0.3, 0.4, 0.3), 0, +1.0, False),
    ("dppo-topk-tv", (0.6, 0.3, 0.1), (0.3, 0.4, 0.3), 0, -1.0, True),
    ("dppo-topk-tv", (0.35, 0.35, 0.3), (0.3, 0.4, 0.3), 0, +1.0, True),
    # TopK-KL (0.05): 0.3 ln 0.5 + 0.4 ln(4/3) + 0.3 ln 3 = 0.2367 > 0.05, r = 2.
    ("dppo-topk-kl", (0.6, 0.3, 0.1), (0.3, 0.4, 0.3), 0, +1.0, False),
    ("dppo-topk-kl", (0.6, 0.3, 0.1), (0.3, 0.4, 0.3), 0, -1.0, True),
    # Case D: DPPO-TopK-KL follows the ratio, PDM the sign of Ddot.
    ("dppo-topk-kl", PI_D, MU_D, K_D, +1.0, False),
    ("dppo-topk-kl", PI_D, MU_D, K_D, -1.0, True),
    ("pdm-agg", PI_D, MU_D, K_D, +1.0, True),
    ("pdm-agg", PI_D, MU_D, K_D, -1.0, False),
    ("pdm-uniform", PI_D, MU_D, K_D, +1.0, True),
    ("pdm-uniform", PI_D, MU_D, K_D, -1.0, False),
    ("pdm-exact", PI_D, MU_D, K_D, +1.0, True),
    ("pdm-exact", PI_D, MU_D, K_D, -1.0, False),
    ("pdm-tv", PI_D, MU_D, K_D, +1.0, True),
    ("pdm-tv", PI_D, MU_D, K_D, -1.0, False),
    ("dppo-topk-tv", PI_D, MU_D, K_D, +1.0, False),
    # PDM inside the region (KL_K = 0.0424 < 0.15 for the §3.2 example): always kept.
    ("pdm-agg", (0.80, 0.06, 0.14), (0.70, 0.05, 0.25), 1, -1.0, True),
    ("pdm-agg", (0.80, 0.06, 0.14), (0.70, 0.05, 0.25), 1, +1.0, True),
]


@pytest.mark.parametrize("preset,pi,mu,k,adv,keep", CASES)
def test_hand_worked_masks(preset, pi, mu, k, adv, keep):
    assert _keep(preset, pi, mu, k, adv) is keep


def test_drpo_weight_and_coefficient():
    """A = +1, mu = 0.3, pi = 0.5, delta = 12.5: w = 1 - 0.2/12.5 = 0.984, coeff = (5/3) w = 1.64;
    A = -1: w = 1 + 0.016 = 1.016, coeff = -(5/3)(1.016). No ratio cap, nothing masked."""
    st = _stats((0.5, 0.3, 0.2), (0.3, 0.4, 0.3), 0)
    cfg = pdm.PolicyLossConfig.preset("drpo")
    for adv, coeff in ((1.0, 1.64), (-1.0, -(5 / 3) * 1.016)):
        out = pdm.policy_loss(st, torch.tensor([adv]), _f64(math.log(0.3)),
                              torch.tensor([True]), cfg)
        assert abs(out.coeff.item() - coeff) < 1e-9 and bool(out.mask[0])
        w = out.metrics[M.DRPO_WEIGHT_MEAN]
        assert abs(w[0].item() - (0.984 if adv > 0 else 1.016)) < 1e-9


def test_ratio_cap_and_gradient():
    """Proximity 'none' keeps everything; coeff = A min(r, C) = 2 * min(9, 5) = 10, and
    d loss / d log pi_k = -coeff, so the logits gradient is -10 (onehot_k - pi)."""
    logits = torch.tensor([[0.9, 0.05, 0.05]], dtype=torch.float64).log().requires_grad_()
    st = pdm.token_stats(logits, torch.tensor([0]), torch.arange(3)[None],
                         torch.tensor([[0.1, 0.45, 0.45]], dtype=torch.float64).log(),
                         torch.ones(1, 3, dtype=torch.bool), tp_group=None, vocab_size=None)
    cfg = pdm.PolicyLossConfig(proximity="none", direction="ratio", ratio_cap=5.0)
    out = pdm.policy_loss(st, torch.tensor([2.0]), _f64(math.log(0.1)),
                          torch.tensor([True]), cfg)
    assert abs(out.coeff.item() - 10.0) < 1e-9
    out[0].backward()
    expected = -10.0 * (torch.tensor([1.0, 0, 0]) - torch.tensor([0.9, 0.05, 0.05]))
    assert torch.allclose(logits.grad[0], expected.double(), atol=1e-9)


def _batch():
    # 5 tokens: seq 0 = rows 0-2, seq 1 = rows 3-4; row 2 is not a loss row; row 4 has A = 0.
    pi = [(0.6, 0.3, 0.1), (0.3, 0.5, 0.2), (0.5, 0.4, 0.1), (0.6, 0.3, 0.1), (0.4, 0.4, 0.2)]
    mu = [(0.4, 0.3, 0.3)] * 5
    k = torch.tensor([0, 0, 0, 0, 0])
    st = pdm.token_stats(torch.tensor(pi, dtype=torch.float64).log(), k,
                         torch.arange(3).expand(5, 3), torch.tensor(mu, dtype=torch.float64).log(),
                         torch.ones(5, 3, dtype=torch.bool), tp_group=None, vocab_size=None)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0])
    lm = torch.tensor([True, True, False, True, True])
    return st, adv, _f64(*[math.log(0.4)] * 5), lm, torch.tensor([0, 0, 0, 1, 1])


def test_aggregations_and_metrics():
    st, adv, blp, lm, seq = _batch()
    base = pdm.PolicyLossConfig.preset("dppo-binary-tv")
    out = pdm.policy_loss(st, adv, blp, lm, base, seq_ids=seq)
    # Binary-TV 0.15: row 0 |0.6-0.4| = 0.2, A > 0 -> masked; row 1 |0.3-0.4| = 0.1 -> kept;
    # row 3 A < 0 with pi > mu -> kept; row 4 A = 0 -> kept and not counted.
    assert out.mask.tolist() == [False, True, True, True, True]
    assert out.metrics[M.MASKED_FRAC].tolist() == [1.0, 3.0]
    assert out.metrics[M.MASKED_FRAC_POS_ADV].tolist() == [1.0, 1.0]
    assert out.metrics[M.MASKED_FRAC_NEG_ADV].tolist() == [0.0, 2.0]
    assert out.metrics[M.OUT_OF_REGION_FRAC].tolist() == [2.0, 3.0]
    assert out.metrics[M.LOSS_PG][1].item() == 4.0
    assert out.coeff[2] == 0 and out.coeff[4] == 0
    # coeff: row 1 = -1 * 0.75, row 3 = -1 * 1.5 -> loss = 0.75 log 0.3 + 1.5 log 0.6.
    loss = 0.75 * math.log(0.3) + 1.5 * math.log(0.6)
    assert abs(out[0].item() - loss) < 1e-9 and out[1].item() == 4
    seq_cfg = base.with_overrides({"aggregation": "seq-mean-token-sum"})
    out2 = pdm.policy_loss(st, adv, blp, lm, seq_cfg, seq_ids=seq)
    assert abs(out2[0].item() - loss) < 1e-9 and out2[1].item() == 2
    norm_cfg = base.with_overrides(["aggregation=seq-mean-token-sum-norm", "loss_horizon=8"])
    out3 = pdm.policy_loss(st, adv, blp, lm, norm_cfg, seq_ids=seq)
    assert abs(out3[0].item() - loss / 8) < 1e-9 and out3[1].item() == 2
    assert set(M.ALL_KEYS) - set(out.metrics) == {M.DRPO_WEIGHT_MEAN, M.IS_WEIGHT_MEAN,
                                                 M.OFFPOLICY_MASKED_FRAC}
    assert all(not v.requires_grad and v.shape == (2,) for v in out.metrics.values())
    with pytest.raises(ValueError, match="needs seq_ids"):
        pdm.policy_loss(st, adv, blp, lm, seq_cfg)
    with pytest.raises(ValueError, match="advantages: expected shape"):
        pdm.policy_loss(st, adv[:3], blp, lm, base)


def test_loss_row_without_support_is_rejected_for_topk():
    st, adv, blp, lm, _ = _batch()
    st.has_support[1] = False
    with pytest.raises(ValueError, match="loss_mask row 1 has no valid support"):
        pdm.policy_loss(st, adv, blp, lm, pdm.PolicyLossConfig.preset("pdm-agg"))


def test_noise_floor_falls_back_to_ratio_direction():
    """With a huge c_rel every token's correction is 'noise': PDM reduces to DPPO (case D)."""
    st = _stats(PI_D, MU_D, K_D)
    cfg = pdm.PolicyLossConfig.preset("pdm-agg", noise_floor=1e6)
    for adv, keep in ((1.0, False), (-1.0, True)):
        out = pdm.policy_loss(st, torch.tensor([adv]), _f64(math.log(0.06)),
                              torch.tensor([True]), cfg)
        assert bool(out.mask[0]) is keep


@pytest.mark.parametrize("field", ["advantages", "behavior_logprob"])
def test_non_finite_inputs_on_loss_rows_raise_naming_row(field):
    import megatron_pdm as pdm
    from tests.support._cases import make_case, op_args

    case = make_case(21, 5, 30, 3)
    stats = pdm.token_stats(case["logits"], *op_args(case), vocab_size=30, tp_group=None)
    adv = torch.ones(5)
    beh = stats.logprob.detach().clone()
    mask = torch.tensor([True, True, False, True, True])
    values = {"advantages": adv, "behavior_logprob": beh}
    values[field] = values[field].clone()
    values[field][2] = float("nan")  # not a loss row: ignored
    pdm.policy_loss(stats, values["advantages"], values["behavior_logprob"], mask,
                    pdm.PolicyLossConfig.preset("pdm-agg"))
    values[field][3] = float("nan")
    with pytest.raises(ValueError, match=rf"{field}: row 3"):
        pdm.policy_loss(stats, values["advantages"], values["behavior_logprob"], mask,
                        pdm.PolicyLossConfig.preset("pdm-agg"))
