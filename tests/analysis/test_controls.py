"""The synthetic controls: the comparison machinery detects an injected effect and stays silent
on an identical criterion (megatron_pdm/analysis/controls.py, inference.py).

Synthetic per-seed token tables (no model): 30 seeds of 40 active tokens, D before the step and
its change after each criterion's step drawn at random, "ratio" and "pdm-agg" keeping random
halves. The oracle control of ratio sets a known fraction of ratio's wrong decisions right; the
copy control is ratio unchanged. Counted by `count_seed` and compared by `summarize` like a
study's criteria (the same Holm family as pdm-agg vs ratio).
"""

from __future__ import annotations

import pytest
import torch

from megatron_pdm import significance
from megatron_pdm.analysis.controls import build_controls, control_keep
from megatron_pdm.analysis.counting import count_seed
from megatron_pdm.analysis.criteria import build_criteria
from megatron_pdm.analysis.summary import summarize
from megatron_pdm.analysis.token_table import TokenTable
from megatron_pdm.config import PolicyLossConfig

N_SEEDS, N_TOKENS, DELTA = 30, 40, 0.05


def _criteria():
    return build_criteria(("ratio", "pdm-agg"), PolicyLossConfig.preset("pdm-agg"),
                          delta_kl=DELTA, delta_tv=0.2)


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = N_TOKENS
    adv = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    d0 = (0.2 * torch.rand(n, generator=g)).double()
    cols = {"adv": adv, "topk_kl": d0, "topk_tv": d0.clone()}
    after = {}
    for name in ("ratio", "pdm-agg"):
        cols[f"keep/{name}"] = (torch.rand(n, generator=g) < 0.5).double()
        cols[f"away/{name}"] = torch.randn(n, generator=g).double()
        dd = 0.05 * torch.randn(n, generator=g).double() + 0.01  # most kept tokens grow
        after[name] = TokenTable({**{k: v for k, v in cols.items()}, "topk_kl": d0 + dd})
    before = TokenTable(cols)
    after = {k: TokenTable({**before.columns, "topk_kl": v["topk_kl"]}) for k, v in after.items()}
    return before, after


def _study(flip: float):
    criteria = _criteria()
    controls = build_controls("ratio", ["ratio", "pdm-agg"], flip=flip)
    seeds = []
    for s in range(1, N_SEEDS + 1):
        before, after = _tables(s)
        seeds.append(count_seed(criteria, before, after, controls=controls, control_seed=s))
    return summarize(seeds, criteria, controls=controls, primary="pdm-agg:ratio"), controls


def test_positive_control_detected_negative_not():
    s, controls = _study(flip=0.5)
    rows = {r["criterion"]: r for r in s["paired"]}
    pos, neg = rows["oracle-ratio"], rows["copy-ratio"]
    assert pos["family_size"] == 3  # pdm-agg vs ratio and both controls: one Holm family
    assert pos["verdict"] == "lower" and pos["p_holm"] < 0.05
    # the oracle never raises the rate; every seed is accounted for
    assert all(d <= 0 for d in pos["per_seed_difference"] if d is not None)
    assert pos["n_seeds_entered"] + pos["n_seeds_no_rate"]["either"] == N_SEEDS
    # at the stated power: the measured effect and SD give power >= 0.8 at these seeds
    assert significance.power_paired(pos["mean_difference"], pos["sd_difference"],
                                     pos["n_seeds_entered"]) >= 0.8
    assert neg["per_seed_difference"] == [0.0] * N_SEEDS
    assert neg["p_holm"] == 1.0 and neg["verdict"] not in ("lower", "higher")
    assert s["controls_check"]["ok"]
    assert rows["pdm-agg"]["primary"] and not pos["primary"]


def test_a_broken_positive_control_is_not_detected():
    """flip = 0: the oracle is its base; the check must fail, so the test above can."""
    s, _ = _study(flip=0.0)
    cc = s["controls_check"]
    assert cc["oracle-ratio"]["verdict"] != "lower" and not cc["oracle-ratio"]["ok"]
    assert not cc["ok"]


def test_oracle_flips_only_wrong_decisions_and_is_deterministic():
    (ctrl, _) = build_controls("ratio", ["ratio"], flip=0.5)
    g = torch.Generator().manual_seed(0)
    kept = torch.rand(200, generator=g) < 0.5
    oor = torch.rand(200, generator=g) < 0.7
    dd = torch.randn(200, generator=g).double()
    k1 = control_keep(ctrl, kept, oor, dd, tol=0.0, seed=7)
    assert torch.equal(k1, control_keep(ctrl, kept, oor, dd, tol=0.0, seed=7))
    assert not torch.equal(k1, control_keep(ctrl, kept, oor, dd, tol=0.0, seed=8))
    changed = k1 != kept
    wrong = oor & ((kept & (dd > 0)) | (~kept & (dd < 0)))
    assert changed.any() and not (changed & ~wrong).any()
    assert 0.3 < changed.sum().item() / wrong.sum().item() < 0.7
    full = build_controls("ratio", ["ratio"], flip=1.0)[0]
    k_all = control_keep(full, kept, oor, dd, tol=0.0, seed=7)
    assert torch.equal(k_all[oor], dd[oor] < 0)  # the oracle: keeps exactly the shrinking


def test_bad_controls_are_refused():
    with pytest.raises(ValueError, match="not among the study's criteria"):
        build_controls("pdm-exact", ["ratio"], flip=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        build_controls("ratio", ["ratio"], flip=1.5)
