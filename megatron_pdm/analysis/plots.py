"""The study's PNG figures (matplotlib, Agg backend), readable without the code.

    paired.png                 unsafe-keep rate per seed, predictive vs ratio direction (one point
                               per seed and criterion, diagonal = equal), and the per-seed
                               differences in percentage points with their mean and 95% interval
    predicted_vs_realised.png  first-order predicted change vs realised change of D_K after one
                               unmasked optimizer step, for the predictive (exact tail) and the
                               ratio (local term only) directions, one point per active token
    global_term.png            histogram of Ddot's global term sum_j pi_j (mu_j - pi_j) (exact tail)
                               and its size against the local term pi_k - mu_k

Inputs: the `summarize` output and the per-token arrays of all seeds (`seed_study.token_arrays`,
concatenated).
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["plot_all"]

_MARKERS = {"pdm-agg": ("o", "tab:blue"), "pdm-uniform": ("s", "tab:green"),
            "pdm-exact": ("^", "tab:red"), "pdm-tv": ("D", "tab:purple")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_paired(summary: dict, path: str, title: str) -> str:
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5))
    lo, hi = 100.0, 0.0
    for k, p in enumerate(summary["paired"]):
        name, base = p["criterion"], p["baseline"]
        a = summary["criteria"][name]["unsafe_keep_rate"]["per_seed"]
        b = summary["criteria"][base]["unsafe_keep_rate"]["per_seed"]
        pts = [(100 * y, 100 * x) for x, y in zip(a, b) if x is not None and y is not None]
        marker, color = _MARKERS.get(name, ("x", f"C{k}"))
        if pts:
            xs, ys = zip(*pts)
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
            ax.scatter(xs, ys, marker=marker, color=color, alpha=0.7,
                       label=f"{name} vs {base}: wins {p['wins']}, losses {p['losses']}, "
                             f"ties {p['ties']}")
        diffs = [100 * d for d in p["per_seed_difference"] if d is not None]
        jitter = torch.linspace(-0.15, 0.15, max(len(diffs), 1)).tolist()
        bx.scatter([k + j for j in jitter[:len(diffs)]], diffs, marker=marker, color=color,
                   alpha=0.6)
        if p["mean_difference"] is not None:
            m = 100 * p["mean_difference"]
            ci = p["bootstrap_ci95_descriptive"]
            err = [[m - 100 * ci[0]], [100 * ci[1] - m]] if ci else None
            bx.errorbar([k + 0.3], [m], yerr=err, fmt="o", color="black", capsize=4)
    pad = max(1.0, 0.05 * (hi - lo))
    lim = (max(0.0, lo - pad), min(100.0, hi + pad)) if hi >= lo else (0.0, 100.0)
    ax.plot(lim, lim, color="grey", lw=1, ls="--", label="equal rates")
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.set_xlabel("unsafe-keep rate, ratio direction (% of kept out-of-region tokens)")
    ax.set_ylabel("unsafe-keep rate, predictive direction (%)")
    ax.set_title("per seed (below the diagonal: predictive keeps fewer unsafe updates)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    names = [p["criterion"] for p in summary["paired"]]
    bx.axhline(0.0, color="grey", lw=1, ls="--")
    bx.set_xticks(range(len(names)))
    bx.set_xticklabels([f"{n}\nminus {p['baseline']}" for n, p in zip(names, summary["paired"])],
                       fontsize=8)
    bx.set_ylabel("difference in unsafe-keep rate (percentage points)")
    bx.set_title("per-seed paired difference (dots); mean and 95% bootstrap interval, descriptive (black)",
                 fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _symlog(ax, axis: str, values: torch.Tensor) -> float:
    """Symmetric log scale on `axis` with a linear zone below the 10% quantile of |values| and
    at most ~4 labelled decades per sign. Returns the linear threshold."""
    mag = values[torch.isfinite(values)].abs()
    mag = mag[mag > 0]
    thresh = float(mag.quantile(0.1)) if len(mag) else 1e-6
    lo = math.floor(math.log10(thresh))
    hi = math.ceil(math.log10(float(mag.max()))) if len(mag) else lo + 1
    step = max(1, math.ceil((hi - lo + 1) / 4))
    # labelled decades from the top down, none at the linear threshold (its label would sit on
    # top of the "0" label)
    decades = [d for d in range(hi, lo, -step)][::-1]
    ticks = [-(10.0 ** d) for d in reversed(decades)] + [0.0] + [10.0 ** d for d in decades]
    labels = ([f"$-10^{{{d}}}$" for d in reversed(decades)] + ["0"]
              + [f"$10^{{{d}}}$" for d in decades])
    if axis == "x":
        ax.set_xscale("symlog", linthresh=thresh)
        ax.set_xticks(ticks, labels)
    else:
        ax.set_yscale("symlog", linthresh=thresh)
        ax.set_yticks(ticks, labels)
    return thresh


def _symlog_scatter(ax, x, y, groups, xlabel: str, title: str) -> None:
    for label, sel, color, size in groups:
        if bool(sel.any()):
            ax.scatter(x[sel].numpy(), y[sel].numpy(), s=size, color=color, alpha=0.5,
                       label=f"{label} ({int(sel.sum())})", linewidths=0)
    finite = torch.isfinite(x) & torch.isfinite(y)
    _symlog(ax, "x", x)
    _symlog(ax, "y", y)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.axvline(0.0, color="black", lw=0.8)
    decided = finite & (x != 0) & (y != 0)
    agree = float(((x > 0) == (y > 0))[decided].double().mean()) if bool(decided.any()) else 0.0
    ax.set_xlabel(xlabel)
    ax.set_ylabel("realised change of D_K after one optimizer step (nats, symlog)")
    ax.set_title(f"{title}\nsign agreement {100 * agree:.1f}% of {int(decided.sum())} tokens "
                 "(quadrants I and III)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def plot_predicted_vs_realised(tok: dict, path: str, title: str, *, ratio_cap: float,
                               disagree_key: str) -> str:
    plt = _plt()
    coeff = tok["adv"] * tok["ratio"].clamp_max(ratio_cap)
    y = tok["delta_d_ref"]
    oor = tok["out_of_region"] > 0
    dis = tok[disagree_key] > 0
    groups = [("in region", ~oor & ~dis, "tab:gray", 6), ("out of region", oor & ~dis,
              "tab:blue", 10), ("directions disagree", dis, "tab:red", 14)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    ddot = tok["local"] + tok["global_exact"]
    _symlog_scatter(axes[0], coeff * ddot, y, groups,
                    "predicted A·min(r,C)·Ḋ_K, exact tail (nats per unit logit step, symlog)",
                    "predictive direction (exact derivative of D_K)")
    _symlog_scatter(axes[1], coeff * tok["local"], y, groups,
                    "A·min(r,C)·(π_k − μ_k): the local term only (symlog)",
                    "ratio direction (sign of A(r − 1))")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_global_term(tok: dict, path: str, title: str) -> str:
    plt = _plt()
    g = tok["global_exact"]
    local = tok["local"]
    oor = tok["out_of_region"] > 0
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    bins = torch.linspace(float(g.min()), float(g.max()), 61).numpy() if len(g) else 10
    ax.hist(g.numpy(), bins=bins, color="tab:gray", alpha=0.7,
            label=f"all active tokens ({len(g)})")
    ax.hist(g[oor].numpy(), bins=bins, color="tab:blue", alpha=0.8,
            label=f"out of region ({int(oor.sum())})")
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)  # a single token still shows as a bar
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_xlabel("global term Σ_j π_j (μ_j − π_j), exact tail (probability², per token)")
    ax.set_ylabel("tokens (log scale)")
    ax.set_title("Ḋ_K = (π_k − μ_k) + global term; the global term is shared by every "
                 "candidate token", fontsize=10)
    ax.legend(fontsize=8)
    flips = (torch.sign(local) != torch.sign(local + g)) & (local != 0)
    bx.scatter(local[~flips].numpy(), g[~flips].numpy(), s=6, color="tab:gray", alpha=0.5,
               label=f"same sign as the local term ({int((~flips).sum())})", linewidths=0)
    bx.scatter(local[flips].numpy(), g[flips].numpy(), s=14, color="tab:red", alpha=0.8,
               label=f"global term flips the sign of Ḋ ({int(flips.sum())})", linewidths=0)
    both = torch.cat([local, g])
    thresh = _symlog(bx, "x", both)
    bx.set_yscale("symlog", linthresh=thresh)  # the same transform: y = -x stays a line
    bx.set_yticks(bx.get_xticks(), [t.get_text() for t in bx.get_xticklabels()])
    span = float(both.abs().max()) if len(both) else 1.0
    line = torch.cat([-torch.logspace(math.log10(span), math.log10(thresh) - 3, 50),
                      torch.logspace(math.log10(thresh) - 3, math.log10(span), 50)])
    bx.plot(line.numpy(), (-line).numpy(), color="black", lw=0.8, ls="--",
            label="global = −local (Ḋ = 0)")
    bx.set_xlabel("local term π_k − μ_k (probability, symlog)")
    bx.set_ylabel("global term Σ_j π_j (μ_j − π_j) (probability², symlog)")
    bx.set_title("where the predictive and ratio directions disagree", fontsize=10)
    bx.legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(summary: dict, tokens: dict, out_dir: str, *, title: str, ratio_cap: float,
             disagree_key: str) -> list[str]:
    """Writes the three PNGs into `out_dir`; returns their paths."""
    return [
        plot_paired(summary, os.path.join(out_dir, "paired.png"), title),
        plot_predicted_vs_realised(tokens, os.path.join(out_dir, "predicted_vs_realised.png"),
                                   title, ratio_cap=ratio_cap, disagree_key=disagree_key),
        plot_global_term(tokens, os.path.join(out_dir, "global_term.png"), title),
    ]
