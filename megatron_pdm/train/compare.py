"""Run several loss presets x seeds (short runs) and plot them side by side.

    python -m megatron_pdm.train.compare --config examples/tiny_cpu/config.yaml \
        --presets grpo dppo-topk-kl pdm-agg drpo --seeds 1 2 --output-dir runs/compare \
        [--set train.iterations=40] [--nproc 2]

Each run is a separate `torchrun -m megatron_pdm.train` (sequential: 2 cores), written to
`<output-dir>/<preset>_s<seed>/`. The script then writes `<output-dir>/compare.png` (the four
panels of report.PANELS, one line per run) and `<output-dir>/compare.md` (one summary row per run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

from megatron_pdm.train.logging_utils import read_metrics
from megatron_pdm.train.report import plot_runs


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(config: str, preset: str, seed: int, out: str, overrides: list[str],
            nproc: int) -> None:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
           "-m", "megatron_pdm.train", "--config", config, "--preset", preset,
           "--output-dir", out, "--set", f"seed={seed}", "--set", "log.progress=false"]
    for item in overrides:
        cmd += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--presets", nargs="+", default=["grpo", "dppo-topk-kl", "pdm-agg", "drpo"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--output-dir", default="runs/compare")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    runs, table = {}, ["| run | RL reward start | RL reward end | greedy acc before RL | "
                       "greedy acc after RL | masked frac | mean abs logprob diff |",
                       "|---|---|---|---|---|---|---|"]
    for preset in args.presets:
        for seed in args.seeds:
            name = f"{preset}_s{seed}"
            out = os.path.join(args.output_dir, name)
            run_one(args.config, preset, seed, out, args.overrides, args.nproc)
            runs[name] = read_metrics(os.path.join(out, "metrics.jsonl"))
            with open(os.path.join(out, "summary.json")) as f:
                s = json.load(f)
            table.append(f"| {name} | {s['rl_reward_initial']:.3f} | {s['rl_reward_final']:.3f} "
                         f"| {s['greedy_acc_before_rl']:.3f} | {s['greedy_acc_after_rl']:.3f} "
                         f"| {s['masked_frac_mean']:.4f} | {s['abs_logprob_diff_mean']:.4f} |")
    plot_runs(runs, os.path.join(args.output_dir, "compare.png"),
              title="presets x seeds: " + ", ".join(args.presets))
    with open(os.path.join(args.output_dir, "compare.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table), flush=True)
    return 0


if __name__ == "__main__":
    from megatron_pdm.cli import run_cli

    sys.exit(run_cli(main))
