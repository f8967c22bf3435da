"""Binning and agreement counting of analysis/tail_fidelity.py on cases computed by hand."""

import math

import pytest
import torch

from megatron_pdm.analysis import tail_fidelity as tf
from megatron_pdm.parallel.vocab_parallel import token_stats


def test_bin_index_edges():
    v = torch.tensor([0.0, 0.0005, 0.001, 0.3, 0.4, 1.0])
    # bins [0, .001) [.001, .01) [.01, .05) [.05, .1) [.1, .2) [.2, .4) [.4, 1]
    assert tf.bin_index(v).tolist() == [0, 0, 1, 5, 6, 6]


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan])
def test_bin_index_refuses_out_of_range(bad):
    with pytest.raises(ValueError, match="position 1"):
        tf.bin_index(torch.tensor([0.5, bad]))


def test_count_by_bin_by_hand():
    bins = torch.tensor([0, 0, 1, 2, 2, 2])
    flag = torch.tensor([True, False, True, False, True, True])
    rows = tf.count_by_bin(bins, 3, {"f": flag})
    assert rows == [{"bin": 0, "tokens": 2, "f": 1}, {"bin": 1, "tokens": 1, "f": 1},
                    {"bin": 2, "tokens": 3, "f": 2}, {"bin": "all", "tokens": 6, "f": 4}]
    with pytest.raises(ValueError, match="flag 'g'"):
        tf.count_by_bin(bins, 3, {"g": flag[:3]})


# Two rows over V = 5, sampled k = 1, support {0, 1} (tail {2, 3, 4}), pi the same on both:
# pi = (0.5, 0.1, 0.3, 0.05, 0.05): pi_T = 0.4, Q_T = 0.095.
# Row 0: mu_S = (0.3, 0.08), mu_T = 0.62, full mu tail (0.5, 0.06, 0.06).
#   local = 0.02, retained = 0.5 (-0.2) + 0.1 (-0.02) = -0.102, mu_T - pi_T = 0.22
#   aggregated: -0.082 + 0.4 * 0.22 = +0.006;  exact: -0.082 + 0.22 * 0.095 / 0.4 = -0.02975
#   uniform: -0.082 + 0.088 / 3 = -0.0527;      full: -0.082 + 0.3*0.2 + 2*0.05*0.01 = -0.021
#   ratio sign(pi_k - mu_k) = +.  D_K = 0.1006 (> 0.05, < 0.15).
# Row 1: mu_S = (0.45, 0.05), mu_T = 0.5, full mu tail (0.3, 0.1, 0.1): every sign +
#   (aggregated 0.06, exact 0.04375, uniform 0.0333, full 0.025, ratio +).
PI = [0.5, 0.1, 0.3, 0.05, 0.05]
MU = [[0.3, 0.08, 0.5, 0.06, 0.06], [0.45, 0.05, 0.3, 0.1, 0.1]]


def _case():
    logits = torch.tensor([PI, PI], dtype=torch.float64).log()
    mu = torch.tensor(MU, dtype=torch.float64)
    sampled = torch.tensor([1, 1])
    ids = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    lp = mu[:, :2].log().float()
    valid = torch.ones(2, 2, dtype=torch.bool)
    stats = token_stats(logits, sampled, ids, lp, valid, tp_group=None, vocab_size=5)
    return stats, logits, mu.log(), sampled, lp[:, 1]


def test_full_kl_ddot_by_hand():
    _, logits, mu_logits, sampled, _ = _case()
    full = tf.full_kl_ddot(logits, mu_logits, sampled)
    assert full.tolist() == pytest.approx([-0.021, 0.025], abs=1e-9)


def test_direction_flags_by_hand():
    stats, logits, mu_logits, sampled, _ = _case()
    flags = tf.direction_flags(stats, tf.full_kl_ddot(logits, mu_logits, sampled))
    expect = {"kl agg != exact": [True, False], "kl unif != exact": [False, False],
              "ratio != kl exact": [True, False], "kl agg != full": [True, False],
              "kl unif != full": [False, False], "kl exact != full": [False, False]}
    for name, want in expect.items():
        assert flags[name].tolist() == want, name


def test_mask_flags_by_hand():
    stats, *_, beh = _case()
    flags = tf.mask_flags(stats, beh, groups=("top-K KL, delta 0.05 (DPPO's)",
                                              "pdm top-K KL, delta 0.15"))
    low = flags["top-K KL, delta 0.05 (DPPO's)"]
    # row 0 (D_K 0.10 > 0.05). A > 0: exact keeps (A Ddot < 0), aggregated drops (+0.006),
    # uniform keeps, ratio drops (A (r-1) > 0). A < 0: exact drops, aggregated and ratio keep.
    # row 1: D_K = 0.45 ln 0.9 + 0.05 ln 0.5 + 0.5 ln 1.25 = 0.0294 < 0.05: never out.
    assert low["out A>0"].tolist() == [True, False]
    assert low["out A<0"].tolist() == [True, False]
    for tag in ("A>0", "A<0"):
        assert low[f"agg {tag}"].tolist() == [True, False]
        assert low[f"unif {tag}"].tolist() == [False, False]
        assert low[f"ratio {tag}"].tolist() == [True, False]
    # delta 0.15: nothing out of region, so no decision can differ
    high = flags["pdm top-K KL, delta 0.15"]
    assert not any(bool(f.any()) for f in high.values())
