"""Off-policy corrections (docs/math.md §10) against an independent float64 reference.

The reference is written from the formulas, not from the implementation: plain Python loops over
tokens and sequences, `math.exp` / `math.log`, dictionaries keyed by sequence id. The trust region
is then combined with each correction for every preset: the corrected coefficient must equal the
uncorrected one with its importance weight replaced and the dropped tokens zeroed.
"""

from __future__ import annotations

import math

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm import metrics as M
from megatron_pdm.config import PRESETS
from megatron_pdm.configtree import ConfigError

# the trust-region presets (every preset but the §10 correction presets icepop / geo-rs, which
# are themselves a correction on the no-trust-region gradient)
TRUST_REGIONS = sorted(p for p in PRESETS if not pdm.PolicyLossConfig.preset(p).off_policy)

CLAMP = 20.0
V = 6
# rows per sequence; -1 is padding (never a loss row), seq 3 has a non-loss row in the middle
SEQ = [0] * 5 + [1] * 4 + [2] * 6 + [3] * 4 + [4] * 3 + [-1] * 2
N = len(SEQ)


def _batch(seed: int, spread: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 1.5
    mu_logits = logits + spread * torch.randn(N, V, generator=g, dtype=torch.float64)
    logmu = torch.log_softmax(mu_logits, -1)
    k = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(1)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    adv[3] = 0.0
    lm = torch.tensor([s >= 0 for s in SEQ])
    lm[16] = False
    return dict(logits=logits, logmu=logmu, k=k, adv=adv, lm=lm,
                seq=torch.tensor(SEQ), blp=logmu.gather(1, k[:, None]).squeeze(1))


def _run(b, cfg, logits=None):
    logits = b["logits"] if logits is None else logits
    st = pdm.token_stats(logits, b["k"], torch.arange(V).expand(N, V), b["logmu"],
                         torch.ones(N, V, dtype=torch.bool), tp_group=None, vocab_size=None)
    return pdm.policy_loss(st, b["adv"], b["blp"], b["lm"], cfg, seq_ids=b["seq"])


def _ref(b, cfg):
    """Per-token (is weight, off-policy keep) from the §10 formulas, in plain loops."""
    rows = range(N)
    logits, k = b["logits"].tolist(), b["k"].tolist()
    log_r = {}
    for t in rows:
        if not b["lm"][t]:
            continue
        z = logits[t]
        logpi = z[k[t]] - math.log(sum(math.exp(x) for x in z))
        log_r[t] = logpi - float(b["blp"][t])
    by_seq: dict[int, list[int]] = {}
    for t in log_r:
        by_seq.setdefault(SEQ[t], []).append(t)
    seq_log = {}
    for s, ts in by_seq.items():
        total = sum(log_r[t] for t in ts)
        seq_log[s] = total if cfg.seq_ratio == "product" else total / len(ts)
    weight, keep = [0.0] * N, [True] * N
    for t in log_r:
        r = math.exp(max(-CLAMP, min(CLAMP, log_r[t])))
        rho = math.exp(max(-CLAMP, min(CLAMP, seq_log[SEQ[t]])))
        weight[t] = min(r if cfg.is_level == "token" else rho, cfg.ratio_cap)
        if cfg.is_mask != "none":
            x = r if cfg.is_mask == "token" else rho
            keep[t] = cfg.is_mask_low <= x <= cfg.is_mask_high
        if cfg.seq_mask_kl is not None:
            ts = by_seq[SEQ[t]]
            kl = sum(-log_r[u] for u in ts) / len(ts)
            if float(b["adv"][t]) < 0 and kl > cfg.seq_mask_kl:
                keep[t] = False
    return weight, keep


CORRECTIONS = [
    dict(ratio_cap=1.0),                                                     # token TIS
    dict(is_level="sequence", seq_ratio="product", ratio_cap=0.2),           # sequence TIS
    dict(is_level="sequence", seq_ratio="geometric", ratio_cap=0.7),
    dict(is_mask="token", is_mask_high=1.6),                                 # token MIS, lo 1/1.6
    dict(is_mask="sequence", seq_ratio="product", is_mask_low=0.5, is_mask_high=2.0),
    dict(is_mask="sequence", seq_ratio="geometric", is_mask_high=1.1),
    dict(seq_mask_kl=0.05),                                                  # OPSM
    dict(is_level="sequence", is_mask="token", is_mask_high=2.5, seq_mask_kl=0.02,
         ratio_cap=3.0),                                                     # all together
]


@pytest.mark.parametrize("corr", range(len(CORRECTIONS)))
def test_corrections_match_the_fp64_reference_loop(corr):
    b = _batch(7)
    cfg = pdm.PolicyLossConfig.preset("is-pg", **CORRECTIONS[corr])
    out = _run(b, cfg)
    weight, keep = _ref(b, cfg)
    for t in range(N):
        a = float(b["adv"][t]) if b["lm"][t] else 0.0
        expected = a * weight[t] * keep[t]
        assert abs(float(out.coeff[t]) - expected) <= 1e-12 * max(1.0, abs(expected)), t
        if b["lm"][t]:
            assert abs(float(out.is_weight[t]) - weight[t]) <= 1e-12 * max(1.0, weight[t]), t
        assert bool(out.mask[t]) == keep[t], t   # True off loss rows, as the trust mask
    # the batch must exercise the rule: something is truncated or dropped, something is not
    lm = b["lm"].tolist()
    dropped = [not keep[t] for t in range(N) if lm[t] and b["adv"][t] != 0]
    if cfg.is_mask != "none" or cfg.seq_mask_kl is not None:
        assert any(dropped) and not all(dropped)
        assert out.metrics[M.OFFPOLICY_MASKED_FRAC].tolist() == [sum(dropped), len(dropped)]
    capped = [weight[t] == cfg.ratio_cap for t in range(N) if lm[t]]
    if math.isfinite(cfg.ratio_cap) and cfg.is_mask == "none" and cfg.seq_mask_kl is None:
        assert any(capped) and not all(capped)


@pytest.mark.parametrize("preset,spread", [("icepop", 1.5), ("geo-rs", 0.002)])
def test_correction_presets_match_the_fp64_reference_loop(preset, spread):
    """The stability benchmark's correction presets: the is-pg gradient times the §10 keep-mask
    of verl 0.9.1's bounds, per token (spread chosen so the rule drops some rows, not all)."""
    b = _batch(13, spread=spread)
    cfg = pdm.PolicyLossConfig.preset(preset)
    out = _run(b, cfg)
    weight, keep = _ref(b, cfg)
    active = [t for t in range(N) if b["lm"][t] and b["adv"][t] != 0]
    assert any(keep[t] for t in active) and not all(keep[t] for t in active)
    for t in range(N):
        a = float(b["adv"][t]) if b["lm"][t] else 0.0
        expected = a * weight[t] * keep[t]
        assert abs(float(out.coeff[t]) - expected) <= 1e-12 * max(1.0, abs(expected)), t
        assert bool(out.mask[t]) == keep[t], t


@pytest.mark.parametrize("preset", TRUST_REGIONS)
@pytest.mark.parametrize("corr", [1, 4, 6, 7])
def test_each_correction_combines_with_every_trust_region(preset, corr):
    """coeff(preset + correction) = coeff(preset) / min(r, C) * w_ref * keep_ref, per token."""
    b = _batch(11, spread=0.5)
    plain_cfg = pdm.PolicyLossConfig.preset(preset)
    cfg = pdm.PolicyLossConfig.preset(preset, **CORRECTIONS[corr])
    plain, out = _run(b, plain_cfg), _run(b, cfg)
    weight, keep = _ref(b, cfg)
    for t in range(N):
        if not b["lm"][t] or b["adv"][t] == 0:
            assert float(out.coeff[t]) == 0.0
            continue
        token_w = min(float(plain.ratio[t]), plain_cfg.ratio_cap)
        expected = float(plain.coeff[t]) / token_w * weight[t] * keep[t]
        assert abs(float(out.coeff[t]) - expected) <= 1e-12 * max(1.0, abs(expected)), (preset, t)
        assert bool(out.mask[t]) == (bool(plain.mask[t]) and keep[t])


def test_defaults_change_nothing_and_the_loss_carries_the_gradient():
    b = _batch(3)
    assert sorted(set(PRESETS) - set(TRUST_REGIONS)) == ["geo-rs", "icepop"]
    for name in TRUST_REGIONS:
        cfg = pdm.PolicyLossConfig.preset(name)
        assert not cfg.off_policy
        assert M.IS_WEIGHT_MEAN not in _run(b, cfg).metrics
    cfg = pdm.PolicyLossConfig.preset("pdm-agg", is_level="sequence", seq_mask_kl=0.01)
    logits = b["logits"].clone().requires_grad_()
    out = _run(b, cfg, logits)
    out.loss_sum.backward()
    # d loss / d z_t = -coeff_t (onehot_k - softmax_t): only rows with coeff != 0 get one
    soft = torch.softmax(b["logits"], -1)
    onehot = torch.nn.functional.one_hot(b["k"], V).double()
    expected = -out.coeff[:, None] * (onehot - soft)
    assert torch.allclose(logits.grad, expected, atol=1e-12)
    assert out.metrics[M.IS_WEIGHT_MEAN][1] == b["lm"].sum()


def test_sequence_corrections_need_seq_ids_and_refuse_padding_loss_rows():
    b = _batch(5)
    cfg = pdm.PolicyLossConfig.preset("grpo", seq_mask_kl=0.1)
    st = pdm.token_stats(b["logits"], b["k"], torch.arange(V).expand(N, V), b["logmu"],
                         torch.ones(N, V, dtype=torch.bool), tp_group=None, vocab_size=None)
    with pytest.raises(ValueError, match=r"seq_mask_kl \(OPSM\) needs seq_ids"):
        pdm.policy_loss(st, b["adv"], b["blp"], b["lm"], cfg)
    lm = b["lm"].clone()
    lm[-1] = True   # a padding row (seq -1) marked as a loss row
    with pytest.raises(ValueError, match=r"seq_ids: row 23 is -1 .*is_level 'sequence'"):
        pdm.policy_loss(st, b["adv"], b["blp"], lm,
                        pdm.PolicyLossConfig.preset("grpo", is_level="sequence"), seq_ids=b["seq"])


@pytest.mark.parametrize("keys, match", [
    (dict(is_mask="token"), "is_mask='token' needs is_mask_high"),
    (dict(is_mask_high=2.0), "is_mask_high=2.0 is set but is_mask='none'"),
    (dict(is_mask="sequence", is_mask_high=2.0, is_mask_low=3.0), "is_mask_low must be in"),
    (dict(is_mask="token", is_mask_high=-1.0), "is_mask_high must be > 0"),
    (dict(seq_mask_kl=-0.1), "seq_mask_kl must be >= 0"),
    (dict(is_level="seq"), "is_level"),
    (dict(seq_ratio="arithmetic"), "seq_ratio"),
])
def test_bad_correction_keys_are_clear_errors(keys, match):
    with pytest.raises(ConfigError, match=match):
        pdm.PolicyLossConfig.preset("pdm-agg", **keys)


def test_keys_load_from_a_mapping_and_resolve_the_lower_bound():
    cfg = pdm.PolicyLossConfig.from_dict({"preset": "pdm-agg", "is_mask": "sequence",
                                          "is_mask_high": "2", "seq_mask_kl": "null"})
    assert cfg.is_mask_low == 0.5 and cfg.seq_mask_kl is None
    assert pdm.PolicyLossConfig.from_dict(cfg.to_dict()) == cfg
    assert pdm.PolicyLossConfig.preset("tis").ratio_cap == 2.0
