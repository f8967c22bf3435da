"""Overlapped rollouts against a real CPU vLLM server: iterations/hour and mismatch, on vs off.

What: starts one vLLM server for the tiny CPU model (megatron_pdm.train.rollout.vllm_server; or uses
--url), then runs the RL driver (torchrun, 2 processes, TP=2) `--reps` times with
`rollout.overlap=false` and `=true` alternately, each for `--iterations` iterations. Per run:

* iterations/hour in the steady state: from the wall-clock stamps of the last row of each
  iteration (`time/unix_s`), over iterations 1..N-1 (iteration 0 is synchronous in both modes
  and carries the start-up);
* the mean over iterations of the first minibatch's `pdm/masked_frac` and
  `mismatch/abs_logprob_diff` (the first minibatch is where overlap changes mu: one version
  stale instead of on-policy), and of all minibatches;
* the machine's load average before and after (the machine may be shared).

Not a timed test: a measurement. Results: JSON (--out) and a markdown table on stdout.

Usage: .venv/bin/python benchmarks/bench_vllm_overlap.py [--reps 3] [--iterations 10]
         [--url http://127.0.0.1:PORT --key-env PDM_VLLM_API_KEY] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_pdm.netutil import LOCAL_TORCHRUN  # noqa: E402  (after the path insert)
CONFIG = ROOT / "examples" / "tiny_cpu" / "config.yaml"
MODEL = ["model.head_dim=32"]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_once(url: str, key_env: str, out: Path, overlap: bool, iterations: int,
             extra: list[str]) -> dict:
    torchrun = Path(sys.executable).parent / "torchrun"
    sets = MODEL + [
        "rollout.engine=vllm", f"rollout.vllm.url={url}", f"rollout.vllm.api_key_env={key_env}",
        f"rollout.overlap={str(overlap).lower()}", f"train.iterations={iterations}",
        "warmup.steps=0", "task.partial_credit=true", "checkpoint.save_interval=0",
        "train.eval_prompts=16", "log.plot=false", "log.tensorboard=false",
        "log.progress=false", f"output_dir={out}"] + extra
    cmd = [str(torchrun), "--nproc-per-node", "2", *LOCAL_TORCHRUN,
           "-m", "megatron_pdm.train", "--config", str(CONFIG)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    load0, t0 = _load(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    last = {}
    for r in rows:
        last[r["iteration"]] = r  # the last row of each iteration
    stamps = [last[i]["time/unix_s"] for i in sorted(last)]
    steady = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    firsts = [r for r in rows if r["minibatch"] == 0]
    later = firsts[1:]  # iteration 0 is on-policy in both modes

    def mean(key, rs):
        vals = [r[key] for r in rs if r.get(key) == r.get(key)]  # drop NaN
        return statistics.fmean(vals) if vals else float("nan")

    return {"overlap": overlap, "iterations": iterations, "wall_s": round(time.time() - t0, 1),
            "steady_iter_s": round(steady, 3), "iters_per_hour": round(3600 / steady, 1),
            "rollout_wait_s": round(mean("time/rollout_s", later), 3),
            "staleness": mean("rollout/staleness", later),
            "masked_frac_first": mean("pdm/masked_frac", later),
            "abs_logprob_diff_first": mean("mismatch/abs_logprob_diff", later),
            "masked_frac_all": mean("pdm/masked_frac", rows[2:]),
            "abs_logprob_diff_all": mean("mismatch/abs_logprob_diff", rows[2:]),
            "reward_last": last[max(last)]["reward/mean"], "load_before": load0,
            "load_after": _load()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--url", default=None, help="use this server (else start one)")
    ap.add_argument("--key-env", default="PDM_VLLM_API_KEY")
    ap.add_argument("--set", action="append", default=[], help="more trainer overrides")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_vllm_overlap.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_vllm_overlap_"))
    server = None
    url = args.url
    if url is None:
        from megatron_pdm.train.config import RunConfig
        from megatron_pdm.train.rollout.vllm_server.model_dir import prepare_model_dir, run_arch
        from megatron_pdm.train.rollout.vllm_server.process import VLLMServer

        arch = run_arch(RunConfig.load(str(CONFIG), MODEL))
        key = secrets.token_hex(16)
        os.environ[args.key_env] = key
        server = VLLMServer(prepare_model_dir(arch, work / "model"), work, api_key=key,
                            max_model_len=arch.max_position_embeddings)
        server.start()
        print(f"vLLM server ready in {server.wait_ready(1800):.0f} s", flush=True)
        url = server.url
    results = []
    try:
        for rep in range(args.reps):
            for overlap in (False, True):
                res = run_once(url, args.key_env, work / f"r{rep}_{int(overlap)}", overlap,
                               args.iterations, args.set)
                res["rep"] = rep
                results.append(res)
                print(json.dumps(res), flush=True)
    finally:
        if server is not None:
            server.stop()
    summary = {}
    for overlap in (False, True):
        rs = [r for r in results if r["overlap"] == overlap]
        summary[str(overlap)] = {
            k: (round(statistics.fmean(r[k] for r in rs), 6),
                round(statistics.pstdev(r[k] for r in rs), 6))
            for k in ("iters_per_hour", "steady_iter_s", "rollout_wait_s", "masked_frac_first",
                      "abs_logprob_diff_first", "masked_frac_all", "abs_logprob_diff_all")}
    report = {"runs": results, "summary_mean_std": summary, "cpus": os.cpu_count(),
              "overrides": args.set}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("\n| overlap | iters/hour | s/iteration | rollout wait s | masked frac (1st mb) | "
          "abs logprob diff (1st mb) | masked frac (all) | abs logprob diff (all) |")
    print("|---|---|---|---|---|---|---|---|")
    for overlap in (False, True):
        s = summary[str(overlap)]
        cells = [f"{s[k][0]:.4g} ± {s[k][1]:.2g}" for k in (
            "iters_per_hour", "steady_iter_s", "rollout_wait_s", "masked_frac_first",
            "abs_logprob_diff_first", "masked_frac_all", "abs_logprob_diff_all")]
        print(f"| {overlap} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
