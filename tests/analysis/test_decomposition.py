"""The decomposition controls beside every unsafe-keep rate, checked by hand on free logits.

A free-logit policy (independent states, the logits are the parameters) with a torch Adam
optimizer whose moments come from three earlier steps. From that state the study takes, per
criterion, its full Adam step, and two controls: the zero-gradient step (Adam's momentum alone:
z1 = z0 - lr * m_hat / (sqrt(v_hat) + eps) with m = beta1 m, v = beta2 v, t + 1) and plain SGD on
the criterion's own masked loss (z1 = z0 + eta * A min(r, C) M (e_k - pi), docs/math.md §3.2).
The test recomputes D_K after both controls in numpy from the saved Adam state, token by token,
and compares every count of the controls exactly (unsafe keep, shrink, flat, own sign accuracy).
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_pdm.analysis.criteria import (
    MOMENTUM_ONLY,
    build_criteria,
    control_key,
    keep_all_config,
)
from megatron_pdm.analysis.seed_study import measure_seed, token_arrays
from megatron_pdm.analysis.summary import summarize
from megatron_pdm.config import PolicyLossConfig
from tests.analysis._free_logit import FreeLogitProbe, make_tokens
from tests.analysis.test_closed_form import _hand_token

N, V, K = 400, 12, 4
DELTA, CAP = 0.05, 5.0
ADAM_LR, SGD_LR = 0.05, 0.5
BETAS, EPS = (0.9, 0.99), 1e-8
NAMES = ("ratio", "pdm-agg", "pdm-exact")


@pytest.fixture(scope="module")
def case():
    tokens = make_tokens(N, V, K, seed=5, noise=0.6)
    base = PolicyLossConfig.preset("pdm-agg", ratio_cap=CAP)
    criteria = build_criteria(NAMES, base, delta_kl=DELTA, delta_tv=0.2)
    probe = FreeLogitProbe(tokens, criteria, lr=ADAM_LR, adam=(*BETAS, EPS))
    probe.prime(keep_all_config(base), steps=3)
    state = {k: (v.clone() if hasattr(v, "clone") else v)
             for k, v in probe.opt.state[probe.z].items()}
    m = measure_seed(probe, criteria, keep_all_config(base), sgd_lr=SGD_LR)
    return tokens, criteria, state, m


def _support(tokens, t):
    valid = tokens["support_valid"][t].numpy()
    ids = tokens["support_ids"][t].numpy()[valid]
    mu_s = np.exp(tokens["support_logprobs"][t].double().numpy()[valid])
    mu_k = float(np.exp(np.float64(tokens["behavior_logprob"][t].item())))
    return ids, mu_s, mu_k


def _hand(tokens, state):
    """Per active token: D, r, away per criterion, keep, and dD after both controls."""
    z0 = tokens["z"].numpy()
    step = float(state["step"]) + 1.0
    m = BETAS[0] * state["exp_avg"].numpy()
    v = BETAS[1] * state["exp_avg_sq"].numpy()
    z_mom = z0 - ADAM_LR * (m / (1 - BETAS[0] ** step)) / (
        np.sqrt(v / (1 - BETAS[1] ** step)) + EPS)
    adv, ks = tokens["adv"].double().numpy(), tokens["k"].numpy()
    rows = []
    for t in range(N):
        if adv[t] == 0:
            continue
        ids, mu_s, mu_k = _support(tokens, t)
        b = _hand_token(z0[t], ids, mu_s, ks[t], mu_k)
        away = {"ratio": adv[t] * (b["r"] - 1.0), "pdm-agg": adv[t] * b["ddot"]["aggregated"],
                "pdm-exact": adv[t] * b["ddot"]["exact"]}
        keep = {n: not (b["D"] > DELTA and away[n] > 0) for n in NAMES}
        d_mom = _hand_token(z_mom[t], ids, mu_s, ks[t], mu_k)["D"] - b["D"]
        d_sgd = {}
        for n in NAMES:
            onehot = np.zeros(V)
            onehot[ks[t]] = 1.0
            z1 = z0[t] + SGD_LR * adv[t] * min(b["r"], CAP) * keep[n] * (onehot - b["pi"])
            d_sgd[n] = _hand_token(z1, ids, mu_s, ks[t], mu_k)["D"] - b["D"]
        rows.append({"D": b["D"], "away": away, "keep": keep, "mom": d_mom, "sgd": d_sgd})
    return rows


def _expected(rows, name, key):
    kept_oor = [r for r in rows if r["D"] > DELTA and r["keep"][name]]
    dd = [(r[key] if key == "mom" else r[key][name]) for r in kept_oor]
    kept = [r for r in rows if r["keep"][name]]
    own = [(r["away"][name] > 0) == ((r[key] if key == "mom" else r[key][name]) > 0)
           for r in kept]
    return {"n_unsafe_kept": sum(d > 0 for d in dd), "n_shrink_kept": sum(d < 0 for d in dd),
            "n_flat_kept": sum(d == 0 for d in dd), "n_kept": len(kept_oor),
            "own_sign_correct": sum(own), "own_sign_decided": len(own)}


def test_zero_gradient_and_own_gradient_counts_equal_hand_computed(case):
    tokens, criteria, state, m = case
    rows = _hand(tokens, state)
    # margins: no realised change of an active token within 1e-9 of 0 (the signs are exact)
    assert min(abs(r["mom"]) for r in rows) > 1e-9
    assert min(abs(d) for r in rows for n, d in r["sgd"].items() if r["keep"][n]) > 1e-9
    for c in criteria:
        got = m.counts["criteria"][c.name]
        for control, key in (("momentum", "mom"), ("gradient", "sgd")):
            want = _expected(rows, c.name, key)
            assert got["n_kept_out_of_region"] == want["n_kept"] > 20
            for k in ("n_unsafe_kept", "n_shrink_kept", "n_flat_kept", "own_sign_correct",
                      "own_sign_decided"):
                assert got[f"{k}@{control}"] == want[k], (c.name, control, k)
            assert got[f"unsafe_keep_rate@{control}"] == pytest.approx(
                want["n_unsafe_kept"] / want["n_kept"], abs=1e-12)
    # the momentum-only step is one table for all criteria; the SGD control is per criterion
    assert MOMENTUM_ONLY in m.after and control_key("ratio", "gradient") in m.after
    # the case is informative: the two controls give different counts
    r = m.counts["criteria"]["ratio"]
    assert r["n_unsafe_kept@momentum"] != r["n_unsafe_kept@gradient"]


def test_without_momentum_the_zero_gradient_step_moves_nothing():
    """Plain SGD has no state: its zero-gradient step leaves every D as it was (all flat)."""
    tokens = make_tokens(120, V, K, seed=9, noise=0.6)
    base = PolicyLossConfig.preset("pdm-agg", ratio_cap=CAP)
    criteria = build_criteria(("ratio", "pdm-agg"), base, delta_kl=DELTA, delta_tv=0.2)
    m = measure_seed(FreeLogitProbe(tokens, criteria, lr=SGD_LR), criteria, None,
                     sgd_lr=SGD_LR)
    for name in ("ratio", "pdm-agg"):
        c = m.counts["criteria"][name]
        assert c["n_kept_out_of_region"] > 5
        assert (c["n_unsafe_kept@momentum"], c["n_shrink_kept@momentum"]) == (0, 0)
        assert c["n_flat_kept@momentum"] == c["n_kept_out_of_region"]
        # SGD at the probe's own lr IS the full step: the gradient control equals it
        for k in ("n_unsafe_kept", "n_shrink_kept", "own_sign_correct"):
            assert c[f"{k}@gradient"] == c[k]


def test_controls_reach_the_summary_and_token_arrays(case):
    _, criteria, _, m = case
    s = summarize([m.counts, m.counts], criteria)
    ratio = s["criteria"]["ratio"]
    for control in ("momentum", "gradient"):
        u = ratio[f"unsafe_keep_rate@{control}"]
        assert u["pooled"] == pytest.approx(m.counts["criteria"]["ratio"][
            f"unsafe_keep_rate@{control}"])
    arrays = token_arrays(m, criteria)
    assert "delta_d_momentum" in arrays and "delta_d_gradient/pdm-agg" in arrays


def test_bad_sgd_lr_is_refused():
    tokens = make_tokens(20, V, K, seed=1, noise=0.6)
    base = PolicyLossConfig.preset("pdm-agg")
    criteria = build_criteria(("ratio",), base, delta_kl=DELTA, delta_tv=0.2)
    with pytest.raises(ValueError, match="sgd_lr"):
        measure_seed(FreeLogitProbe(tokens, criteria, lr=0.1), criteria, None, sgd_lr=0.0)
