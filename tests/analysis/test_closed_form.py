"""The study's counts and rates on a free-logit policy equal hand-computed ones.

A free-logit policy (the logits of 600 independent states are the parameters) takes one SGD step
on the summed surrogate, so each token's logits move by exactly eta * A min(r, C) M (e_k - pi)
(docs/math.md §1, §3.2) and the realised change of D_K is known in closed form. The library runs
its own protocol (`measure_seed`: evaluate, snapshot, one step per criterion, restore, verify) and
counting (`count_seed`) through `token_stats` / `policy_loss`; the test recomputes everything
from the formulas of §2.3, §3.2, §3.3 in numpy float64, token by token with plain loops (no
library code), and compares every count exactly and every rate to 1e-12.

The optional TV pair is checked the same way for the ratio-tv criterion (counted on D_TV,K with
its own delta).

Margins are checked too, so the exact comparison is not luck: no token lies within 1e-9 of a
decision boundary (D = delta, Ddot = 0, r = 1, dD = 0 for kept tokens; masked tokens do not
move at all).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_pdm.analysis.criteria import KEEP_ALL, build_criteria, keep_all_config
from megatron_pdm.analysis.seed_study import measure_seed
from megatron_pdm.config import PolicyLossConfig
from tests.analysis._free_logit import FreeLogitProbe, make_tokens

N, V, K = 600, 12, 4
DELTA, CAP, LR = 0.05, 5.0, 1.5
NAMES = ("ratio", "pdm-agg", "pdm-uniform", "pdm-exact")
TAILS = {"pdm-agg": "aggregated", "pdm-uniform": "uniform", "pdm-exact": "exact"}


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _hand_token(z, ids, mu_s, k, mu_k):
    """D_K, Ddot per tail and r of one token (§2.3, §3.3, §7.1)."""
    pi = _softmax(z)
    in_s = np.zeros(V, dtype=bool)
    in_s[ids] = True
    pi_s = pi[ids]
    mu_t = max(0.0, 1.0 - mu_s.sum())
    pi_t = pi[~in_s].sum()
    q_t = (pi[~in_s] ** 2).sum()
    d = float((mu_s * np.log(mu_s / pi_s)).sum())
    if mu_t > 0:
        d += mu_t * math.log(mu_t / pi_t)
    local = pi[k] - mu_k
    retained = float((pi_s * (mu_s - pi_s)).sum())
    tau = {"aggregated": pi_t * (mu_t - pi_t),
           "uniform": pi_t * (mu_t - pi_t) / (V - len(ids)),
           "exact": (mu_t - pi_t) * q_t / pi_t}
    ddot = {name: local + retained + tau[name] for name in tau}
    return {"pi": pi, "D": d, "ddot": ddot, "r": pi[k] / mu_k}


def _hand(tokens):
    """Everything the study reports, by hand."""
    z0 = tokens["z"].numpy()
    adv = tokens["adv"].double().numpy()
    ks = tokens["k"].numpy()
    rows = []
    for t in range(N):
        valid = tokens["support_valid"][t].numpy()
        ids = tokens["support_ids"][t].numpy()[valid]
        mu_s = np.exp(tokens["support_logprobs"][t].double().numpy()[valid])
        mu_k = float(np.exp(np.float64(tokens["behavior_logprob"][t].item())))
        before = _hand_token(z0[t], ids, mu_s, ks[t], mu_k)
        a = adv[t]
        away = {"ratio": a * (before["r"] - 1.0)}
        away.update({name: a * before["ddot"][tail] for name, tail in TAILS.items()})
        keep = {name: not (before["D"] > DELTA and away[name] > 0) for name in NAMES}
        keep[KEEP_ALL] = True
        delta_d = {}
        for name in (*NAMES, KEEP_ALL):
            coeff = a * min(before["r"], CAP) * keep[name]
            onehot = np.zeros(V)
            onehot[ks[t]] = 1.0
            z1 = z0[t] + LR * coeff * (onehot - before["pi"])  # the closed-form SGD step
            delta_d[name] = _hand_token(z1, ids, mu_s, ks[t], mu_k)["D"] - before["D"]
        rows.append({"adv": a, "D": before["D"], "r": before["r"], "ddot": before["ddot"],
                     "away": away, "keep": keep, "dD": delta_d})
    return rows


def _expected(rows):
    active = [r for r in rows if r["adv"] != 0]
    oor = [r for r in active if r["D"] > DELTA]
    out = {}
    for name in NAMES:
        kept_oor = [r for r in oor if r["keep"][name]]
        unsafe = sum(1 for r in kept_oor if r["dD"][name] > 0)
        shrink = sum(1 for r in kept_oor if r["dD"][name] < 0)
        own = [(r["away"][name] > 0) == (r["dD"][name] > 0) for r in active
               if r["keep"][name]]
        e = {"n_out_of_region": len(oor), "n_kept_out_of_region": len(kept_oor),
             "n_masked_out_of_region": len(oor) - len(kept_oor), "n_unsafe_kept": unsafe,
             "n_shrink_kept": shrink, "unsafe_keep_rate": unsafe / len(kept_oor),
             "shrink_share": shrink / len(kept_oor),
             "own_sign_accuracy": sum(own) / len(own)}
        ref = [(r["away"][name] > 0) == (r["dD"][KEEP_ALL] > 0) for r in active]
        e["pred_accuracy"] = sum(ref) / len(ref)
        if name != "ratio":
            dis = [r for r in active if (r["away"][name] > 0) != (r["away"]["ratio"] > 0)]
            e["n_disagree"] = len(dis)
            e["n_disagree_out_of_region"] = sum(1 for r in dis if r["D"] > DELTA)
            e["pred_disagree_accuracy"] = sum(
                (r["away"][name] > 0) == (r["dD"][KEEP_ALL] > 0) for r in dis) / len(dis)
            e["pred_baseline_disagree_accuracy"] = sum(
                (r["away"]["ratio"] > 0) == (r["dD"][KEEP_ALL] > 0) for r in dis) / len(dis)
        out[name] = e
    return out, len(active)


@pytest.fixture(scope="module")
def case():
    tokens = make_tokens(N, V, K, seed=7, noise=0.6)
    base = PolicyLossConfig.preset("pdm-agg", ratio_cap=CAP)
    criteria = build_criteria(NAMES, base, delta_kl=DELTA, delta_tv=0.2)
    probe = FreeLogitProbe(tokens, criteria, lr=LR)
    m = measure_seed(probe, criteria, keep_all_config(base))
    return tokens, m, _hand(tokens)


def test_decisions_are_not_at_a_boundary(case):
    _, _, rows = case
    for r in rows:
        if r["adv"] == 0:
            continue
        assert abs(r["D"] - DELTA) > 1e-9 and abs(r["r"] - 1.0) > 1e-9
        assert min(abs(x) for x in r["ddot"].values()) > 1e-9
        for name, dd in r["dD"].items():
            # A masked token's logits do not move at all (independent states): dD is exactly 0.
            assert abs(dd) > 1e-9 if r["keep"][name] else dd == 0.0


def test_counts_and_rates_equal_hand_computed(case):
    _, m, rows = case
    want, n_active = _expected(rows)
    got = m.counts
    assert got["n_tokens"] == N and got["n_active"] == n_active
    # The case is informative: out-of-region tokens, disagreements, masks that differ.
    assert want["ratio"]["n_out_of_region"] > 100
    assert want["pdm-agg"]["n_disagree_out_of_region"] > 5
    assert want["ratio"]["n_kept_out_of_region"] != want["pdm-agg"]["n_kept_out_of_region"]
    for name, e in want.items():
        c = got["criteria"][name]
        for key in ("n_out_of_region", "n_kept_out_of_region", "n_masked_out_of_region",
                    "n_unsafe_kept", "n_shrink_kept"):
            assert c[key] == e[key], (name, key, c[key], e[key])
        for key in ("unsafe_keep_rate", "shrink_share", "own_sign_accuracy"):
            assert c[key] == pytest.approx(e[key], abs=1e-12), (name, key)
        p = got["prediction"][name]
        assert p["accuracy"] == pytest.approx(e["pred_accuracy"], abs=1e-12), name
        if name != "ratio":
            assert c["n_disagree"] == e["n_disagree"]
            assert c["n_disagree_out_of_region"] == e["n_disagree_out_of_region"]
            assert p["disagree_accuracy"] == pytest.approx(e["pred_disagree_accuracy"],
                                                           abs=1e-12)
            assert p["baseline_disagree_accuracy"] == pytest.approx(
                e["pred_baseline_disagree_accuracy"], abs=1e-12)
            # On the disagreement set the two signs differ: exactly one of them is right.
            assert p["disagree_accuracy"] + p["baseline_disagree_accuracy"] == pytest.approx(1.0)


def test_realised_changes_equal_the_closed_form(case):
    _, m, rows = case
    active = [r for r in rows if r["adv"] != 0]
    for name in (*NAMES, KEEP_ALL):
        got = (m.after[name]["topk_kl"] - m.before["topk_kl"]).numpy()[
            m.before["adv"].numpy() != 0]
        want = np.array([r["dD"][name] for r in active])
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_restore_failure_is_reported():
    """A probe whose restore silently fails must make measure_seed raise, naming what differs."""
    tokens = make_tokens(40, V, K, seed=3, noise=0.6)
    base = PolicyLossConfig.preset("pdm-agg")
    criteria = build_criteria(("ratio", "pdm-agg"), base, delta_kl=DELTA, delta_tv=0.2)
    probe = FreeLogitProbe(tokens, criteria, lr=LR)
    probe.restore = lambda snap: None  # steps accumulate: the state never returns
    with pytest.raises(RuntimeError, match="not bit-exact"):
        measure_seed(probe, criteria, None)


def _hand_tv(z, ids, mu_s):
    pi = _softmax(z)
    in_s = np.zeros(V, dtype=bool)
    in_s[ids] = True
    mu_t = max(0.0, 1.0 - mu_s.sum())
    return 0.5 * (np.abs(mu_s - pi[ids]).sum() + abs(mu_t - pi[~in_s].sum())), pi


def test_tv_ratio_criterion_counts_on_the_tv_divergence():
    """The optional TV pair: ratio-tv is counted on D_TV,K (§2.3) with its own delta."""
    tokens = make_tokens(300, V, K, seed=11, noise=0.6)
    base = PolicyLossConfig.preset("pdm-tv")
    delta_tv = 0.1
    criteria = build_criteria(("ratio-tv", "pdm-tv"), base, delta_kl=DELTA, delta_tv=delta_tv)
    m = measure_seed(FreeLogitProbe(tokens, criteria, lr=LR), criteria, None)
    z0, adv, ks = tokens["z"].numpy(), tokens["adv"].double().numpy(), tokens["k"].numpy()
    oor = kept = unsafe = 0
    for t in range(300):
        valid = tokens["support_valid"][t].numpy()
        ids = tokens["support_ids"][t].numpy()[valid]
        mu_s = np.exp(tokens["support_logprobs"][t].double().numpy()[valid])
        mu_k = float(np.exp(np.float64(tokens["behavior_logprob"][t].item())))
        d0, pi = _hand_tv(z0[t], ids, mu_s)
        r = pi[ks[t]] / mu_k
        out = adv[t] != 0 and d0 > delta_tv
        keep = not (d0 > delta_tv and adv[t] * (r - 1.0) > 0)
        onehot = np.zeros(V)
        onehot[ks[t]] = 1.0
        z1 = z0[t] + LR * adv[t] * min(r, base.ratio_cap) * keep * (onehot - pi)
        d1, _ = _hand_tv(z1, ids, mu_s)
        oor += out
        kept += out and keep
        unsafe += out and keep and d1 - d0 > 0
    c = m.counts["criteria"]["ratio-tv"]
    assert c["divergence"] == "topk_tv" and c["delta"] == delta_tv
    assert (c["n_out_of_region"], c["n_kept_out_of_region"], c["n_unsafe_kept"]) == (
        oor, kept, unsafe)
    assert oor > 50 and kept > 10
    assert m.counts["criteria"]["pdm-tv"]["n_out_of_region"] == oor
