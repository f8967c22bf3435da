"""Run several loss presets x seeds from one shared warm-up and plot them side by side.

    python -m megatron_pdm.train.compare --config examples/tiny_cpu/config.yaml \
        --presets grpo dppo-topk-kl pdm-agg drpo --seeds 1 2 --output-dir runs/compare \
        [--set train.iterations=100] [--nproc 2] [--threads 1]

1. The supervised warm-up runs once (the config's seed) with `--save-warmup`, into
   `<output-dir>/warmup/` (reused when it exists and was made from the same config).
2. Every (preset, seed) is a separate `torchrun -m megatron_pdm.train` (sequential) that starts
   RL from those weights (`checkpoint.load_dir`, `warmup.steps=0`; a fresh optimizer, as after
   the main job's warm-up), written to `<output-dir>/<preset>_s<seed>/`.
3. `<output-dir>/compare.png` (report.PANELS, one smoothed line per run, one legend) and
   `<output-dir>/compare.md` (one summary row per run).

Progress lines report each run's wall time and an estimate of the time left.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from megatron_pdm.netutil import LOCAL_TORCHRUN
from megatron_pdm.train.logging_utils import read_metrics
from megatron_pdm.train.report import plot_runs

TRACKER = "latest_checkpointed_iteration.txt"


def _torchrun(args: list[str], nproc: int, threads: int, prefix: list[str] = (),
              log_path: str | None = None) -> None:
    """One driver run; `prefix` wraps it (e.g. megatron_pdm.train.rollout.vllm_server ... --, which
    starts the engine server, fills `{vllm_url}` into the arguments and stops it after). With
    `log_path`, the run's stdout and stderr go to that file (runs side by side) instead of ours."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [*prefix, torchrun, "--nproc-per-node", str(nproc), *LOCAL_TORCHRUN,
           "-m", "megatron_pdm.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if log_path is None:
        subprocess.run(cmd, check=True, env=env)
        return
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def shared_warmup(config: str, out: str, overrides: list[str], nproc: int, threads: int) -> dict:
    """The warm-up checkpoint of `config` + `overrides` in `out` (made once, then reused).

    With `warmup.steps=0` there is no warm-up to share: the runs start from the config's own
    `checkpoint.load_dir` (e.g. a converted pretrained model), returned as the record's
    `start_dir`, and each run measures its own evaluation before RL (`evals` is empty)."""
    from megatron_pdm.configtree import ConfigError
    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.warmup_export import WARMUP_FILE

    cfg = RunConfig.load(config, overrides + [f"output_dir={out}"])
    wanted = cfg.to_dict()
    if cfg.warmup.steps == 0:
        if not cfg.checkpoint.load_dir:
            raise ConfigError("warmup.steps=0 and no checkpoint.load_dir: the runs would start "
                              "from a random model each; set checkpoint.load_dir (e.g. a "
                              "converted checkpoint) or warmup.steps > 0")
        start = os.path.abspath(cfg.checkpoint.load_dir)
        print(f"compare: no warm-up (warmup.steps=0): every run starts from {start}", flush=True)
        return {"evals": {}, "wall_s": 0.0, "config": wanted, "start_dir": start}
    record_path = os.path.join(out, WARMUP_FILE)
    if os.path.exists(os.path.join(out, TRACKER)) and os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
        if record.get("config") == wanted:
            print(f"compare: reusing the warm-up in {out}", flush=True)
            return record
    _torchrun(["--config", config, *_sets(overrides), "--output-dir", out, "--set",
               "log.progress=false", "--save-warmup", out], nproc, threads)
    with open(record_path) as f:
        return json.load(f)


def run_one(config: str, preset: str, seed: int, out: str, warm_dir: str, overrides: list[str],
            nproc: int, threads: int, prefix: list[str] = (), log_path: str | None = None) -> None:
    sets = [*overrides, f"seed={seed}", f"checkpoint.load_dir={warm_dir}", "warmup.steps=0",
            "log.progress=false"]  # after the user's overrides: these must win
    _torchrun(["--config", config, "--preset", preset, "--output-dir", out, *_sets(sets)],
              nproc, threads, prefix, log_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--presets", nargs="+", default=["grpo", "dppo-topk-kl", "pdm-agg", "drpo"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--output-dir", default="runs/compare")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    args = p.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    t0 = time.time()
    warm_dir = os.path.abspath(os.path.join(args.output_dir, "warmup"))
    warm = shared_warmup(args.config, warm_dir, args.overrides, args.nproc, args.threads)
    ev = warm["evals"]
    print(f"compare: warm-up {int(ev.get('warmup_steps', 0))} steps, greedy accuracy "
          f"{ev.get('before_rl', float('nan')):.3f} ({time.time() - t0:.0f} s)", flush=True)
    header = ("| run | RL reward start | RL reward end | greedy acc before RL | "
              "greedy acc after RL | masked frac | mean abs logprob diff | wall s |")
    runs, table = {}, [header, "|---|---|---|---|---|---|---|---|"]
    jobs = [(preset, seed) for preset in args.presets for seed in args.seeds]
    for k, (preset, seed) in enumerate(jobs, 1):
        name = f"{preset}_s{seed}"
        out = os.path.join(args.output_dir, name)
        t1 = time.time()
        run_one(args.config, preset, seed, out, warm.get("start_dir", warm_dir), args.overrides,
                args.nproc, args.threads)
        took = time.time() - t1
        runs[name] = read_metrics(os.path.join(out, "metrics.jsonl"))
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        table.append(f"| {name} | {s['rl_reward_initial']:.3f} | {s['rl_reward_final']:.3f} "
                     f"| {s['greedy_acc_before_rl']:.3f} | {s['greedy_acc_after_rl']:.3f} "
                     f"| {s['masked_frac_mean']:.4f} | {s['abs_logprob_diff_mean']:.4f} "
                     f"| {took:.0f} |")
        print(f"compare: {k}/{len(jobs)} {name} done in {took:.0f} s, ~{took * (len(jobs) - k):.0f}"
              f" s left", flush=True)
    plot_runs(runs, os.path.join(args.output_dir, "compare.png"),
              title="presets x seeds from one warm-up: " + ", ".join(args.presets))
    with open(os.path.join(args.output_dir, "compare.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table), flush=True)
    print(f"compare: {len(jobs)} runs in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    from megatron_pdm.cli import run_cli

    sys.exit(run_cli(main))
