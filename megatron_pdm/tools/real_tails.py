"""The op on the real model's distributions: top-K mass and the tail estimators' fidelity.

    python -m megatron_pdm.tools.real_tails [--tokens 2048] [--top-k 20] [--json PATH]

For each RL pair of megatron_pdm/analysis/real_logits.py (`bf16`: fp32 trainer vs bf16 engine;
`step`: the policy one Adam step after the rollout vs the rollout model) it builds the engine's
top-K support from mu's logits, runs `token_stats` (validated) on pi's logits over the full
vocabulary (V = 49,152) and prints, by behaviour tail-mass bin (analysis/tail_fidelity.py):
the distribution of the support mass, the direction disagreements of the aggregated / uniform
tails with the exact one (and of all three with the full-vocabulary KL direction), and the
mask-decision disagreements at the presets' thresholds. Writes everything to --json, with the
run time. The logits are built on first use (a few minutes on 1 thread) and cached in .cache/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from megatron_pdm.analysis import real_logits as rl
from megatron_pdm.analysis import tail_fidelity as tf

QS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9)
DIR_COLS = ("kl agg != exact", "kl unif != exact", "tv agg != exact", "tv unif != exact",
            "kl agg != full", "kl unif != full", "kl exact != full", "ratio != kl exact")


def _bin_label(b, edges=tf.TAIL_BINS) -> str:
    if b == "all":
        return "all"
    close = "]" if b == len(edges) - 2 else ")"
    return f"[{edges[b]:g}, {edges[b + 1]:g}{close}"


def _pct(num: int, den: int) -> str:
    r = tf.rate(num, den)
    return "-" if r is None else f"{100 * r:.1f}% ({num})"


def analyse_pair(data: rl.RealLogits, pair: str, top_k: int) -> dict:
    """All tables of one RL pair, as plain data."""
    from megatron_pdm.parallel.vocab_parallel import token_stats

    pi_NV, mu_NV = data.pair(pair)
    ids, lp, valid, beh_N = rl.engine_support(mu_NV, data.sampled_ids, top_k)
    stats = token_stats(pi_NV, data.sampled_ids, ids, lp, valid, tp_group=None,
                        vocab_size=pi_NV.shape[1], validate=True)
    full_N = tf.full_kl_ddot(pi_NV, mu_NV, data.sampled_ids)
    del pi_NV, mu_NV
    mu_tail_N = stats.mu_tail.double().clamp(0.0, 1.0)
    bins_N = tf.bin_index(mu_tail_N)
    n_bins = len(tf.TAIL_BINS) - 1
    direction = tf.count_by_bin(bins_N, n_bins, tf.direction_flags(stats, full_N))
    masks = {g: tf.count_by_bin(bins_N, n_bins, f)
             for g, f in tf.mask_flags(stats, beh_N).items()}
    return {
        "pair": pair, "pi_mu": rl.PAIRS[pair], "tokens": int(bins_N.numel()), "top_k": top_k,
        "support_mass_quantiles": tf.quantiles(1.0 - mu_tail_N, QS),
        "pi_support_mass_quantiles": tf.quantiles(1.0 - stats.pi_tail.double(), QS),
        "sampled_in_top_k": float((~valid[:, -1]).double().mean()),
        "topk_kl_quantiles": tf.quantiles(stats.topk_kl.double(), (0.5, 0.9, 0.99, 1.0)),
        "direction_uncertain": float(stats.direction_uncertain.double().mean()),
        "direction": direction, "masks": masks,
    }


def _print_pair(res: dict) -> None:
    pi, mu = res["pi_mu"]
    print(f"\n## pair {res['pair']}: pi = {pi}, mu = {mu}; N = {res['tokens']}, K = "
          f"{res['top_k']}; sampled token in mu's top-K: {100 * res['sampled_in_top_k']:.1f}%; "
          f"§7.2 direction uncertain: {100 * res['direction_uncertain']:.1f}%")
    q = res["support_mass_quantiles"]
    print("support mass (mu, top-K + sampled) quantiles: "
          + ", ".join(f"q{100 * k:g} {v:.3f}" for k, v in q.items()))
    print("top-K KL quantiles: " + ", ".join(f"q{100 * k:g} {v:.2e}"
                                             for k, v in res["topk_kl_quantiles"].items()))
    print("\n| mu tail mass | tokens | " + " | ".join(DIR_COLS) + " |")
    print("|---" * (len(DIR_COLS) + 2) + "|")
    for row in res["direction"]:
        print(f"| {_bin_label(row['bin'])} | {row['tokens']} | "
              + " | ".join(_pct(row[c], row["tokens"]) for c in DIR_COLS) + " |")
    print("\nmask decisions (each token under A > 0 and under A < 0; out = D > delta; "
          "differs = keep/drop differs from the exact tail's, A > 0 / A < 0; per-bin counts "
          "in the JSON)")
    print("| proximity, delta | out of region | aggregated differs | uniform differs | "
          "ratio direction differs | bins of the out-of-region tokens (A > 0) |")
    print("|---|---|---|---|---|---|")
    for group, rows in res["masks"].items():
        tot = rows[-1]
        cells = [f"{tot[f'{s} A>0']} / {tot[f'{s} A<0']}" for s in ("out", "agg", "unif", "ratio")]
        where = ", ".join(f"{_bin_label(r['bin'])}: {r['out A>0']}" for r in rows[:-1]
                          if r["out A>0"])
        print(f"| {group} | " + " | ".join(cells) + f" | {where or '-'} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_pdm.tools.real_tails",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(rl.DEFAULT_MODEL_DIR))
    ap.add_argument("--tokens", type=int, default=rl.RealLogitsConfig.tokens)
    ap.add_argument("--step-lr", type=float, default=rl.RealLogitsConfig.step_lr)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", default="bf16,step")
    ap.add_argument("--json", type=Path, default=Path("runs/real_tails.json"))
    args = ap.parse_args(argv)
    if not rl.model_available(args.model_dir):
        print(f"no prepared real model at {args.model_dir}: run `make real-model` first",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cfg = rl.RealLogitsConfig(model_dir=args.model_dir, tokens=args.tokens,
                              step_lr=args.step_lr, threads=args.threads)
    data = rl.load_or_build(cfg)
    t_logits = time.perf_counter() - t0
    results = [analyse_pair(data, p, args.top_k) for p in args.pairs.split(",")]
    total = time.perf_counter() - t0
    print(f"real model {args.model_dir}: {data.meta.get('sequences_used')} sampled responses, "
          f"N = {args.tokens}; step: Adam lr {cfg.step_lr:g}, parameter change L2 "
          f"{data.meta.get('step_param_change_l2', float('nan')):.3g}")
    for res in results:
        _print_pair(res)
    print(f"\ntime: {total:.1f} s ({t_logits:.1f} s logits {'cache' if t_logits < 30 else 'build'}"
          f", threads {torch.get_num_threads()})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": data.meta, "bins": list(tf.TAIL_BINS),
                                     "pairs": results, "time_s": total,
                                     "logits_s": t_logits, "threads": torch.get_num_threads()},
                                    indent=1, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
