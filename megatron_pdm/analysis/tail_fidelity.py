"""The three tail estimators against the exact one, binned by tail mass (docs/math.md §3.3, §7.1).

On a batch's `TokenStats` (policy pi against the engine's top-K support of mu) this counts, in
bins of the behaviour tail mass mu_T = 1 - (mass of the support: top-K plus the sampled token):

direction (no advantage needed): how often sign(Ddot) of the aggregated / uniform tail differs
    from the exact tail's (the exact derivative of D_K, §7.1), for the Top-K KL and the Top-K TV
    (§3.6); how often each of the three differs from the full-vocabulary KL's Ddot (computed
    from the full mu, which an engine never returns: the truth the tail models stand in for);
    and how often the ratio direction sign(r - 1) differs from the exact tail's.
mask (`MASK_GROUPS`): each token is evaluated under both advantage signs, A = +1 and A = -1
    (the decision depends on sign(A) only), through `policy_loss` with the presets' thresholds;
    counted: tokens out of region (D > delta) and tokens whose keep/drop decision differs from
    the exact tail's criterion with the same proximity and delta.

Signs: sign() with 0 as its own value; "differs" compares the three-valued signs.
Counts are ints per bin plus a total row; rates are left to the caller (`rate`).

Shape legend: N tokens, V vocabulary, B bins.
"""

from __future__ import annotations

import torch

from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.ops.stats import TokenStats

__all__ = ["MASK_GROUPS", "TAIL_BINS", "bin_index", "count_by_bin", "direction_flags",
           "full_kl_ddot", "mask_flags", "quantiles", "rate"]

TAIL_BINS = (0.0, 0.001, 0.01, 0.05, 0.1, 0.2, 0.4, 1.0)
"""Edges of the behaviour tail-mass bins [e_i, e_{i+1}); the last bin includes 1."""

TAILS = ("aggregated", "uniform", "exact")

MASK_GROUPS: dict[str, tuple[str, dict]] = {
    # group -> (preset, overrides): the tail axis is swept over TAILS; "ratio" = the same
    # proximity and delta with the ratio direction (DPPO's rule), for context
    "pdm top-K KL, delta 0.15": ("pdm-exact", {}),
    "top-K KL, delta 0.05 (DPPO's)": ("pdm-exact", {"delta_low": 0.05, "delta_high": 0.05}),
    "top-K TV, delta 0.2 (DPPO's)": ("pdm-tv", {}),
}


def rate(num: int, den: int) -> float | None:
    """num / den, None when den == 0."""
    return None if den == 0 else num / den


def bin_index(values_N: torch.Tensor, edges=TAIL_BINS) -> torch.Tensor:
    """[N] long bin of each value: i with edges[i] <= v < edges[i+1], the last bin closed.
    Values outside [edges[0], edges[-1]] are an error (a tail mass is in [0, 1])."""
    v = values_N.double()
    lo, hi = float(edges[0]), float(edges[-1])
    bad = (v < lo) | (v > hi) | torch.isnan(v)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"value {float(v[row])} at position {row} outside the bins [{lo}, {hi}]")
    inner = torch.tensor(edges[1:-1], dtype=torch.float64)
    return torch.bucketize(v, inner, right=True)


def count_by_bin(bins_N: torch.Tensor, n_bins: int, flags: dict[str, torch.Tensor],
                 ) -> list[dict[str, int]]:
    """Per bin (then one "all" row): {"tokens": n, flag: count of True, ...}."""
    rows = []
    for b in list(range(n_bins)) + [None]:
        sel_N = torch.ones_like(bins_N, dtype=torch.bool) if b is None else bins_N == b
        row = {"bin": "all" if b is None else b, "tokens": int(sel_N.sum())}
        for name, flag_N in flags.items():
            if flag_N.shape != bins_N.shape:
                raise ValueError(f"flag {name!r} has shape {tuple(flag_N.shape)}, the bins "
                                 f"{tuple(bins_N.shape)}")
            row[name] = int((flag_N & sel_N).sum())
        rows.append(row)
    return rows


def quantiles(values_N: torch.Tensor, qs=(0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9)) -> dict:
    """{q: value} of a 1-D tensor (fp64, linear interpolation)."""
    v = values_N.double()
    return {q: float(x) for q, x in zip(qs, torch.quantile(v, torch.tensor(qs, dtype=v.dtype)))}


def full_kl_ddot(pi_logits_NV: torch.Tensor, mu_logits_NV: torch.Tensor,
                 sampled_N: torch.Tensor) -> torch.Tensor:
    """[N] Ddot of the full-vocabulary KL(mu || pi) along e_k - pi (§3.2), fp64:
    (pi_k - mu_k) + sum_j pi_j (mu_j - pi_j)."""
    out = []
    for r0 in range(0, pi_logits_NV.shape[0], 256):  # row chunks: fp64 copies stay small
        pi = torch.softmax(pi_logits_NV[r0:r0 + 256].double(), -1)
        mu = torch.softmax(mu_logits_NV[r0:r0 + 256].double(), -1)
        k = sampled_N[r0:r0 + 256].long()[:, None]
        out.append((pi.gather(1, k) - mu.gather(1, k))[:, 0] + (pi * (mu - pi)).sum(-1))
    return torch.cat(out)


def _differs(a_N: torch.Tensor, b_N: torch.Tensor) -> torch.Tensor:
    return torch.sign(a_N) != torch.sign(b_N)


def direction_flags(stats: TokenStats, full_ddot_N: torch.Tensor | None = None,
                    ) -> dict[str, torch.Tensor]:
    """[N] bool flags of sign disagreement (module docstring), keyed "kl agg != exact" etc."""
    kl = {t: stats.divergence_rate("kl", t) for t in TAILS}
    tv = {t: stats.divergence_rate("tv", t) for t in TAILS}
    ratio_dir_N = stats.pi_k - stats.mu_k  # sign(r - 1) = sign(pi_k - mu_k)
    flags = {
        "kl agg != exact": _differs(kl["aggregated"], kl["exact"]),
        "kl unif != exact": _differs(kl["uniform"], kl["exact"]),
        "tv agg != exact": _differs(tv["aggregated"], tv["exact"]),
        "tv unif != exact": _differs(tv["uniform"], tv["exact"]),
        "ratio != kl exact": _differs(ratio_dir_N, kl["exact"]),
    }
    if full_ddot_N is not None:
        for t, short in (("aggregated", "agg"), ("uniform", "unif"), ("exact", "exact")):
            flags[f"kl {short} != full"] = _differs(kl[t].double(), full_ddot_N.double())
    return flags


def _group_cfgs(group: str) -> dict[str, PolicyLossConfig]:
    preset, overrides = MASK_GROUPS[group]
    base = PolicyLossConfig.preset(preset).with_overrides(overrides)
    cfgs = {t: base.with_overrides({"tail": t}) for t in TAILS}
    cfgs["ratio"] = base.with_overrides({"direction": "ratio"})
    return cfgs


def mask_flags(stats: TokenStats, behavior_logprob_N: torch.Tensor,
               groups=tuple(MASK_GROUPS)) -> dict[str, dict[str, torch.Tensor]]:
    """{group: {"out A>0", "out A<0", "agg A>0", ...: [N] bool}}: out of region per advantage
    sign, and decisions that differ from the exact tail's (agg / unif / ratio vs exact)."""
    from megatron_pdm.loss.policy_loss import policy_loss

    n = stats.pi_k.shape[0]
    ones_N = torch.ones(n, dtype=torch.bool)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in groups:
        cfgs = _group_cfgs(group)
        flags: dict[str, torch.Tensor] = {}
        for sign, tag in ((1.0, "A>0"), (-1.0, "A<0")):
            adv_N = torch.full((n,), sign)
            res = {name: policy_loss(stats, adv_N, behavior_logprob_N, ones_N, cfg)
                   for name, cfg in cfgs.items()}
            delta = cfgs["exact"].delta_high if sign > 0 else cfgs["exact"].delta_low
            flags[f"out {tag}"] = res["exact"].divergence > delta
            for name, short in (("aggregated", "agg"), ("uniform", "unif"), ("ratio", "ratio")):
                flags[f"{short} {tag}"] = res[name].mask != res["exact"].mask
        out[group] = flags
    return out
