"""`megatron-pdm-eval-heldout`: the held-out evaluation of a served model, without a trainer.

    python -m megatron_pdm.train.rollout.vllm_server --config CFG --model-dir HF_DIR \\
        --set rollout.vllm.url=http://127.0.0.1:0 --max-model-len 512 --kv-cache-mb 512 -- \\
        python tools/eval_heldout.py --config CFG --set "rollout.vllm.url={vllm_url}" \\
            [--set train.eval_prompts=200 --set train.eval_samples=1 ...] \\
            --output-dir DIR [--name after_rl] [--iteration K]

The vLLM server serves the model to evaluate (any HF directory of the config's architecture:
another trainer's output, e.g. TRL's, or the model before RL). This command asks it for the run
config's held-out problems exactly as the driver's evaluation does
(megatron_pdm/train/evaluation.py `run_heldout`): the same problems
(`task.eval_problems(seed, train.eval_prompts)`), greedy plus `train.eval_samples` samples per
problem at `rollout.temperature`, the same prompts, response cap, stop token and scoring. It
appends the record (named `--name`) to DIR/eval.jsonl, so it pairs by problem with a driver
run's records and with `megatron-pdm-learning-report`, and writes DIR/heldout.json (every record
of DIR/eval.jsonl summarised with intervals, and the gain before_rl -> after_rl when both are
there). It pushes no weights: what the server loaded is what is measured. The driver's
trainer-forward cross-check (`train.eval_crosscheck`) needs the trainer's model and is not made
here (the record's crosscheck is null).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="megatron-pdm-eval-heldout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run config (the task and the evaluation keys)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override; rollout.vllm.url is the served model's server")
    p.add_argument("--output-dir", required=True, help="eval.jsonl and heldout.json go here")
    p.add_argument("--name", default="after_rl",
                   help="the record's name (before_rl, after_rl, rl_iter<k>, ...)")
    p.add_argument("--iteration", type=int, default=0, help="the record's iteration")
    return p.parse_args(argv)


def evaluate(cfg, output_dir: str, *, name: str, iteration: int) -> dict:
    """Evaluates the model served at cfg.rollout.vllm.url on cfg's held-out problems; appends the
    record to output_dir/eval.jsonl and returns {"record": ..., "server": ..., "seconds": ...}."""
    from megatron_pdm.configtree import ConfigError
    from megatron_pdm.train import evaluation as ev
    from megatron_pdm.train.rollout.feed import sampling_params
    from megatron_pdm.train.rollout.vllm import vllm_client
    from megatron_pdm.train.task import build_task

    if cfg.rollout.engine != "vllm":
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r}: this command evaluates a model "
                         "served by vLLM (rollout.engine=vllm, rollout.vllm.url)")
    t = cfg.train
    if t.eval_prompts < 1:
        raise ConfigError(f"train.eval_prompts={t.eval_prompts}: nothing to evaluate")
    task = build_task(cfg)
    problems = task.eval_problems(cfg.seed, t.eval_prompts)
    # the server's own vocabulary (a model may pad its output layer beyond the tokenizer's)
    info = vllm_client(cfg, None).check_server()
    client = vllm_client(cfg, info["facts"][0].get("vocab_size"))

    def generate(probs, temperature, n):
        return client.generate([task.prompt_ids(q) for q in probs],
                               sampling_params(task, temperature), n=n)

    t0 = time.time()
    rec, _ = ev.run_heldout(name, iteration, task, problems, generate,
                            aside=contextlib.nullcontext, eval_samples=t.eval_samples,
                            temperature=cfg.rollout.temperature)
    seconds = time.time() - t0
    os.makedirs(output_dir, exist_ok=True)
    ev.append_record(output_dir, rec)
    server = {"model": info.get("model"), "vllm_version": info.get("vllm_version"),
              "dtype": info["facts"][0].get("dtype"), "weight_version": info.get("weight_version")}
    summary = {"server": server, "seconds": seconds,
               "heldout": ev.summarize_heldout(ev.read_records(output_dir), seed=cfg.seed)}
    with open(os.path.join(output_dir, "heldout.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return {"record": rec, "server": server, "seconds": seconds}


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_pdm.train import evaluation as ev
    from megatron_pdm.train.config import RunConfig

    cfg = RunConfig.load(args.config, args.set)
    out = evaluate(cfg, args.output_dir, name=args.name, iteration=args.iteration)
    print(f"eval {args.name}: {ev.describe(out['record'])} ({out['seconds']:.0f} s; served "
          f"model {out['server']['model']}, {out['server']['dtype']}) -> "
          f"{os.path.join(args.output_dir, ev.EVAL_FILE)}", flush=True)
    return 0


def cli() -> int:
    """Console-script entry point: `main` with the project's one-line error handling."""
    from megatron_pdm.cli import run_cli

    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
