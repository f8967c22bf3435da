"""TRL's GRPOTrainer side by side with this project's driver on the real model (CPU).

Three runs on the same work (benchmarks/trl_compare.py says what "same" covers and what differs):
this project's driver with the GRPO preset and with PDM (`pdm-agg`), both with a vLLM CPU server
(`make demo-real`'s command, `examples/real_cpu/config.yaml` with the `--set` overrides given),
and TRL's `GRPOTrainer` with HF `generate` in one process. Each side reports seconds per
iteration, generated tokens per second and held-out greedy accuracy (word task, `eval_prompts`
held-out problems) before and after the same number of iterations.

Subcommands (TRL is a benchmark-only extra, `.venv-trl` from scripts/setup_trl_cpu.sh; the
driver runs from the project's own `.venv`):

    python benchmarks/bench_trl_grpo.py driver --preset grpo --out-dir results/trl_compare \
        [--set train.iterations=3 ...]            # runs the driver and summarises its run
    .venv-trl/bin/python benchmarks/bench_trl_grpo.py trl --out-dir results/trl_compare \
        [--set ...] [--trl-threads 2]             # runs TRL on the same settings
    python benchmarks/bench_trl_grpo.py table --out-dir results/trl_compare [--baseline trl]
    python benchmarks/bench_trl_grpo.py eval --model-dir DIR --eval-dir D [--name after_rl] \
        [--into trl] [--set ...]                  # the driver's held-out evaluation of an HF
                                                  # directory (e.g. TRL's --save-model) via vLLM
    python benchmarks/bench_trl_grpo.py paired --a DIR... --b DIR... [--record after_rl]
                                                  # B - A per problem, per seed and pooled

`all` runs the three in that order and writes the table. Every run writes
`<out-dir>/<name>.json`; `table` writes `compare.json` and `compare.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import trl_compare as tc  # noqa: E402

CONFIG = "examples/real_cpu/config.yaml"
MODEL_DIR = ".cache/real-model/smollm2-135m-instruct"
MCORE_DIR = ".cache/real-model/smollm2-135m-instruct-mcore"
VPY = str(ROOT / ".venv/bin/python")  # the project's venv (TRL's side runs from .venv-trl)


def _machine() -> dict:
    from megatron_pdm.hostinfo import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_at_end": os.getloadavg(), "unix_s": time.time()}


def _driver_config(sets: list[str]) -> dict:
    from megatron_pdm.train.config import RunConfig

    # the URL only satisfies the rollout section's check: nothing is served for this side
    return RunConfig.load(str(ROOT / CONFIG), ["rollout.vllm.url=http://127.0.0.1:1", *sets]
                          ).to_dict()


# ---------------------------------------------------------------- the driver

def _served(model_dir: str, sets: list[str]) -> list[str]:
    """The launcher prefix that serves `model_dir` as `make demo-real` does (fp32, 512-token
    context) and runs the command after it with `{vllm_url}` filled in."""
    return [VPY, "-m", "megatron_pdm.train.rollout.vllm_server", "--config", CONFIG,
            "--set", "rollout.vllm.url=http://127.0.0.1:0", *sets, "--model-dir", model_dir,
            "--max-model-len", "512", "--kv-cache-mb", "512", "--"]


def driver_command(preset: str, out: str, sets: list[str], *, mcore_dir: str,
                   threads: int) -> list[str]:
    """`make demo-real`'s command (Makefile) with the preset, output dir and overrides."""
    return [*_served(MODEL_DIR, []),
            "env", f"OMP_NUM_THREADS={threads}", str(ROOT / ".venv/bin/torchrun"),
            "--nproc-per-node", "1", "--standalone", "--local-addr", "127.0.0.1",
            "-m", "megatron_pdm.train", "--config", CONFIG,
            "--set", "rollout.vllm.url={vllm_url}", "--set", f"checkpoint.load_dir={mcore_dir}",
            "--set", f"task.tokenizer_dir={MODEL_DIR}", "--set", "checkpoint.allow_fresh_start=true",
            "--set", f"loss.preset={preset}", "--set", f"output_dir={out}",
            *[a for s in sets for a in ("--set", s)]]


def _correct(acc, n: int) -> tuple[int, int]:
    """(correct, n) from an accuracy over n problems; (0, 0) for a run without the evaluation
    (train.eval_prompts=0: summary.json's accuracy is NaN)."""
    if not n or acc is None or math.isnan(acc):
        return (0, 0)
    return (round(acc * n), n)


def summarize_driver(name: str, run_dir: str) -> dict:
    """One driver run's numbers from its metrics.jsonl, summary.json and config.yaml."""
    import yaml

    rows = [json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl"))]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    shared = tc.shared_settings(cfg)
    last = {}
    for r in rows:  # the iteration's last row carries its time (time/iteration_s)
        last[r["iteration"]] = r
    its = [last[k] for k in sorted(last)]
    n = shared["eval_prompts"]
    phases = {key: [r.get(key, 0.0) for r in its] for key in (
        "time/rollout_s", "time/train_step_s", "time/fwd_bwd_s", "time/optimizer_s",
        "time/weight_sync_s", "time/iteration_s")}
    return tc.run_summary(
        name, [r["time/iteration_s"] for r in its],
        [round(r["rollout/response_len"] * r["rollout/num_samples"]) for r in its],
        _correct(summary.get("greedy_acc_before_rl"), n), _correct(summary.get("greedy_acc_after_rl"), n),
        shared=shared, phases=phases, reward_mean=[r["reward/mean"] for r in its],
        engine="vLLM CPU server (fp32) + megatron-core trainer", run_dir=run_dir)


def cmd_driver(a) -> dict:
    out = a.run_dir or f"runs/trl_compare_{a.preset}"
    name = a.name or f"driver-{a.preset}"
    if not a.summarize_only:
        cmd = driver_command(a.preset, out, a.set, mcore_dir=a.mcore_dir, threads=a.threads)
        # rollout and step take turns (rollout.overlap off): each phase gets every core unless
        # --vllm-reserved keeps some from vLLM's worker (Makefile demo-real, VLLM_RESERVED)
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=str(ROOT),
                   VLLM_CPU_NUM_OF_RESERVED_CPU=str(a.vllm_reserved))
        t0 = time.time()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        print(f"driver {a.preset}: {time.time() - t0:.0f} s from the command to the end")
    res = summarize_driver(name, str(ROOT / out) if not os.path.isabs(out) else out)
    res["machine"] = _machine()
    res["command"] = " ".join(sys.argv)
    _write(a.out_dir, name, res)
    return res


# ---------------------------------------------------------------- TRL

def _greedy_eval(model, task, problems: list[int], batch: int) -> tuple[int, int]:
    """Greedy HF generate on `problems` (left padding), scored by the task's own rule."""
    import torch

    tok = task.tokenizer
    correct = 0
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        ids = [task.prompt_ids(p) for p in chunk]
        width = max(len(x) for x in ids)
        inp = torch.full((len(ids), width), task.pad_id, dtype=torch.long)
        att = torch.zeros((len(ids), width), dtype=torch.long)
        for j, x in enumerate(ids):
            inp[j, width - len(x):] = torch.tensor(x)
            att[j, width - len(x):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=inp, attention_mask=att, do_sample=False,
                                 max_new_tokens=task.max_new_tokens, eos_token_id=task.eos_id,
                                 pad_token_id=task.pad_id)
        for p, row in zip(chunk, out[:, width:].tolist()):
            resp = row[:row.index(task.eos_id) + 1] if task.eos_id in row else row
            correct += int(task.score(p, resp))
    del tok
    return correct, len(problems)


def cmd_trl(a) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_pdm.train.word_task import SUFFIX, WordProblemTask

    torch.set_num_threads(a.trl_threads)
    shared = tc.shared_settings(_driver_config(a.set))
    task = WordProblemTask(str(ROOT / MODEL_DIR), max_operand=shared["max_operand"],
                           max_new_tokens=shared["max_new_tokens"],
                           heldout_fraction=shared["heldout_fraction"])
    if task.tokenizer.eos_token_id != task.eos_id:
        raise ValueError("the tokenizer's eos is not the task's eos")
    problems = [p for k in range(shared["iterations"])
                for p in task.problems(shared["seed"], k, shared["prompts_per_iteration"])]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": task.problem(p)[0] + SUFFIX}],
                             "problem": p} for p in problems])
    tokens: list[int] = []
    rewards: list[float] = []

    def reward(prompts, completions, completion_ids, problem, **kw):
        out = [task.score(p, ids) for p, ids in zip(problem, completion_ids)]
        tokens.append(sum(len(ids) for ids in completion_ids))
        rewards.append(sum(out) / len(out))
        return out

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            print(f"trl step {len(times)}: {times[-1]:.1f} s", flush=True)

    model = AutoModelForCausalLM.from_pretrained(str(ROOT / MODEL_DIR), dtype=torch.float32)
    evalset = task.eval_problems(shared["seed"], shared["eval_prompts"])
    t0 = time.time()
    # --skip-eval: speed only (seconds per iteration, tokens per second); accuracies nan
    before = (0, 0) if a.skip_eval else _greedy_eval(model, task, evalset, a.eval_batch)
    eval_s = time.time() - t0
    cfg = GRPOConfig(**tc.grpo_config_kwargs(shared, output_dir=str(ROOT / "runs/trl_grpo")))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=task.tokenizer, callbacks=[Timer()])
    t1 = time.time()
    trainer.train()
    train_s = time.time() - t1
    after = (0, 0) if a.skip_eval else _greedy_eval(trainer.model, task, evalset, a.eval_batch)
    if a.save_model:  # for `eval`: the same held-out evaluation as the driver's, through vLLM
        trainer.save_model(a.save_model)
        task.tokenizer.save_pretrained(a.save_model)
    res = tc.run_summary(
        "trl", times, tokens, before, after, shared=shared, reward_mean=rewards,
        engine="HF transformers generate in the training process (TRL use_vllm=False)",
        trl_threads=a.trl_threads, train_wall_s=train_s, eval_wall_s=eval_s,
        versions={"trl": trl.__version__, "transformers": transformers.__version__,
                  "torch": torch.__version__},
        grpo_config={k: v for k, v in tc.grpo_config_kwargs(shared, output_dir="-").items()})
    res["machine"] = _machine()
    res["command"] = " ".join(sys.argv)
    _write(a.out_dir, "trl", res)
    return res


# ---------------------------------------------------------------- eval (vLLM)

def eval_command(model_dir: str, eval_dir: str, name: str, sets: list[str]) -> list[str]:
    """Serve `model_dir` (fp32, as `make demo-real` serves the model) and run the driver's
    held-out evaluation on it (megatron_pdm/tools/eval_heldout.py), record `name` into
    `eval_dir`/eval.jsonl."""
    over = [x for s in sets for x in ("--set", s)]
    return [*_served(model_dir, over), VPY, "-m", "megatron_pdm.tools.eval_heldout", "--config", CONFIG,
            "--set", "rollout.vllm.url={vllm_url}", "--set", f"task.tokenizer_dir={MODEL_DIR}",
            *over, "--output-dir", eval_dir, "--name", name]


def cmd_eval(a) -> None:
    if not a.summarize_only:
        t0 = time.time()
        subprocess.run(eval_command(a.model_dir, a.eval_dir, a.name, a.set), cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
        print(f"eval {a.name} of {a.model_dir}: {time.time() - t0:.0f} s from the command to the end")
    if a.into:  # the side's accuracies become the vLLM evaluation's (same evaluator both sides)
        from megatron_pdm.train import evaluation as ev

        recs = ev.read_records(a.eval_dir)
        path = os.path.join(a.out_dir, a.into + ".json")
        with open(path) as f:
            res = json.load(f)
        for key, rec_name in (("acc_before", "before_rl"), ("acc_after", "after_rl")):
            if rec_name in recs:
                r = recs[rec_name]
                res[key] = [int(round(sum(r.greedy))), len(r.problems)]
        res["eval"] = {"how": "vLLM CPU server (fp32) serving the side's saved weights, the "
                       "driver's evaluation (megatron-pdm-eval-heldout)", "eval_dir": a.eval_dir,
                       "heldout": ev.summarize_heldout(recs)}
        _write(a.out_dir, a.into, res)


def cmd_paired(a) -> dict:
    """Per problem, run B's evaluation `--record` against run A's (same problems): for each
    pair of directories (one seed each) the difference B - A with its bootstrap interval and
    McNemar p (evaluation.summarize_heldout), and over the pairs the difference pooled by problem
    (analysis/learning.py `pooled_gain`: mean over pairs, bootstrap over problems, sign-flip p)."""
    from megatron_pdm.analysis.learning import pooled_gain
    from megatron_pdm.train import evaluation as ev

    if len(a.a) != len(a.b):
        raise ValueError(f"--a has {len(a.a)} directories and --b {len(a.b)}: one pair per seed")
    pairs, runs = [], []
    for da, db in zip(a.a, a.b):
        ra, rb = ev.read_records(da).get(a.record), ev.read_records(db).get(a.record)
        if ra is None or rb is None:
            raise ValueError(f"no {a.record!r} record in {da if ra is None else db}")
        s = ev.summarize_heldout({"A": ra, "B": rb}, start="A", end="B")
        pairs.append({"A": da, "B": db, "gain": s["gain"]})
        runs.append({"dir": db, "seed": len(runs), "records": {"A": ra, "B": rb}})
    out = {"record": a.record, "pairs": pairs,
           "pooled": pooled_gain(runs, start="A", end="B")}
    print(json.dumps(out["pooled"], indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


# ---------------------------------------------------------------- table

def cmd_table(a) -> None:
    names = a.runs or ["trl", "driver-grpo", "driver-pdm-agg"]
    runs = [json.load(open(os.path.join(a.out_dir, n + ".json"))) for n in names]
    if a.first:  # compare the same iterations (the first N) where the runs have more
        runs = [tc.run_summary(r["name"], r["iteration_s"][:a.first],
                               r["response_tokens"][:a.first], tuple(r["acc_before"]),
                               tuple(r["acc_after"]) if r["iterations"] == a.first else (0, 0))
                for r in runs]
    rows = tc.ratio_rows(runs, a.baseline)
    md = tc.markdown_table(rows, a.baseline)
    with open(os.path.join(a.out_dir, "compare.json"), "w") as f:
        json.dump({"rows": rows, "differences": list(tc.DIFFERENCES),
                   "shared": runs[0].get("shared"), "machine": _machine()}, f, indent=1)
    with open(os.path.join(a.out_dir, "compare.md"), "w") as f:
        f.write(md + "\n\nWhat differs:\n" + "".join(f"- {d}\n" for d in tc.DIFFERENCES))
    print(md)


def _write(out_dir: str, name: str, res: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, (dict, list))}, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("driver", "trl", "all", "table", "eval"):
        s = sub.add_parser(name)
        s.add_argument("--out-dir", default="results/trl_compare")
        s.add_argument("--set", action="append", default=[],
                       help="driver config override (key=value), applied to both sides")
        if name in ("driver", "all"):
            s.add_argument("--preset", default="grpo")
            s.add_argument("--run-dir", default=None)
            s.add_argument("--name", default=None)
            s.add_argument("--mcore-dir", default=MCORE_DIR)
            s.add_argument("--threads", type=int, default=2,
                           help="the driver's trainer threads (make demo-real's default)")
            s.add_argument("--vllm-reserved", type=int, default=0,
                           help="VLLM_CPU_NUM_OF_RESERVED_CPU for the driver's vLLM server (0: "
                           "its worker gets every core; vLLM's own default reserves one)")
            s.add_argument("--summarize-only", action="store_true")
        if name in ("trl", "all"):
            s.add_argument("--trl-threads", type=int, default=2)
            s.add_argument("--eval-batch", type=int, default=16)
            s.add_argument("--skip-eval", action="store_true",
                           help="no held-out evaluation on the TRL side (HF generate is slow)")
            s.add_argument("--save-model", default=None, metavar="DIR",
                           help="save TRL's trained model (HF directory) for `eval`")
        if name == "eval":
            s.add_argument("--model-dir", required=True, help="HF directory to serve")
            s.add_argument("--eval-dir", required=True, help="its eval.jsonl goes here")
            s.add_argument("--name", default="after_rl", help="the record's name")
            s.add_argument("--into", default=None, metavar="RUN",
                           help="put the accuracies into <out-dir>/RUN.json (e.g. trl)")
            s.add_argument("--summarize-only", action="store_true")
        if name in ("table", "all"):
            s.add_argument("--baseline", default="trl")
            s.add_argument("--runs", nargs="*", default=None)
            s.add_argument("--first", type=int, default=0,
                           help="use the first N iterations of every run (accuracy only where a "
                           "run had exactly N)")
    s = sub.add_parser("paired", help="per-problem difference of two evaluation directories")
    s.add_argument("--a", nargs="+", required=True,
                   help="eval directories of side A (the reference), one per seed")
    s.add_argument("--b", nargs="+", required=True,
                   help="eval directories of side B, in the same seed order")
    s.add_argument("--record", default="after_rl")
    s.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.cmd == "eval":
        cmd_eval(a)
    elif a.cmd == "paired":
        cmd_paired(a)
    elif a.cmd == "driver":
        cmd_driver(a)
    elif a.cmd == "trl":
        cmd_trl(a)
    elif a.cmd == "table":
        cmd_table(a)
    else:
        for preset in ("grpo", "pdm-agg"):
            a.preset, a.name, a.run_dir = preset, None, None
            cmd_driver(a)
        trl_py = str(ROOT / ".venv-trl/bin/python")
        subprocess.run([trl_py, __file__, "trl", "--out-dir", a.out_dir,
                        "--trl-threads", str(a.trl_threads), "--eval-batch", str(a.eval_batch),
                        *(["--skip-eval"] if a.skip_eval else []),
                        *[x for s in a.set for x in ("--set", s)]], check=True)
        a.runs = None
        cmd_table(a)


if __name__ == "__main__":
    main()
