"""Model profiles of the stability grid (`megatron-pdm-stability --model NAME`): which config,
sizes, warm-up and engine server every run of the grid uses.

- `tiny` (default): examples/tiny_cpu/config.yaml, a supervised warm-up shared by all runs, the
  local engine (no server; the vLLM setting starts its own, grid.SERVER_SETTINGS).
- `real`: SmolLM2-135M-Instruct (examples/real_cpu/config.yaml, docs/real-model.md). No warm-up:
  RL starts from the converted pretrained checkpoint (`checkpoint.load_dir`, `--real-mcore-dir`),
  the task's tokenizer is the HF directory (`task.tokenizer_dir`, `--real-hf-dir`), and every run
  gets its own vLLM CPU server on that HF directory (fp32, 512-token context, as `make
  demo-real`), the trainer's weights pushed in fp32 (`rollout.rollout_precision=fp32`: the server
  holds exactly the trainer's weights, so its greedy evaluation measures the trained model and the
  only off-policy stress is the setting's). Each run measures its own accuracy before RL.

Every size is a plain driver `--set` key; `--set` on the command line comes after them and wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_pdm.stability import grid as G

REAL_HF_DIR = os.path.join(".cache", "real-model", "smollm2-135m-instruct")
REAL_MCORE_DIR = os.path.join(".cache", "real-model", "smollm2-135m-instruct-mcore")

_QUIET = ["log.plot=false", "log.progress=false", "log.tensorboard=false",
          "checkpoint.save_interval=0", "checkpoint.allow_fresh_start=true"]

# The real model's sizes: 4 prompts x 8 samples per iteration (the committed config's batch),
# 64 held-out problems (greedy; the same problems in every run), few iterations (one iteration
# is ~1-2.5 min on 2 CPU cores, docs/real-model.md).
REAL_SIZES: list[str] = [
    "parallel.tp=1", "train.iterations=6", "train.minibatches_per_iteration=1",
    "rollout.prompts_per_iteration=4", "rollout.group_size=8", "train.eval_prompts=64",
    "rollout.rollout_precision=fp32", "warmup.steps=0", *_QUIET,
]
REAL_SMOKE_SIZES: list[str] = [
    "parallel.tp=1", "train.iterations=1", "train.minibatches_per_iteration=1",
    "rollout.prompts_per_iteration=2", "rollout.group_size=4", "train.eval_prompts=4",
    "rollout.rollout_precision=fp32", "warmup.steps=0", *_QUIET,
]
# vLLM launcher arguments of every real-model run (megatron_pdm.train.rollout.vllm_server), as
# `make demo-real` starts it; the server's url is filled into `{vllm_url}` of the driver's keys
REAL_SERVER: list[str] = ["--max-model-len", "512", "--kv-cache-mb", "512"]


@dataclass(frozen=True)
class Profile:
    name: str
    config: str
    sizes: list[str]
    smoke_sizes: list[str]
    warmup: list[str] = field(default_factory=list)
    smoke_warmup: list[str] = field(default_factory=list)
    server: list[str] | None = None  # launcher args for every run; None: no server per run


def tiny() -> Profile:
    return Profile("tiny", os.path.join("examples", "tiny_cpu", "config.yaml"), list(G.SIZES),
                   list(G.SMOKE_SIZES), smoke_warmup=list(G.SMOKE_WARMUP))


def real(hf_dir: str = REAL_HF_DIR, mcore_dir: str = REAL_MCORE_DIR, *,
         check: bool = True) -> Profile:
    """The real-model profile; `check`: both directories must exist (clear errors naming the
    option, before any run starts)."""
    hf_dir, mcore_dir = os.path.abspath(hf_dir), os.path.abspath(mcore_dir)
    if check:
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise ValueError(f"--real-hf-dir {hf_dir}: no config.json (an HF model directory; "
                             "the real model: make real-model)")
        if not os.path.isfile(os.path.join(mcore_dir, "pdm_model.json")):
            raise ValueError(f"--real-mcore-dir {mcore_dir}: no pdm_model.json (the converted "
                             "checkpoint: megatron_pdm.tools.convert_hf_to_megatron --hf-dir "
                             f"{hf_dir} --out {mcore_dir} --tp 1, as make demo-real does)")
    # the url quoted: a YAML string (not a mapping) also before the launcher fills it in
    paths = [f"checkpoint.load_dir={mcore_dir}", f"task.tokenizer_dir={hf_dir}",
             "rollout.engine=vllm", "rollout.vllm.url='{vllm_url}'"]
    server = ["--set", "rollout.vllm.url=http://127.0.0.1:0", "--model-dir", hf_dir,
              *REAL_SERVER]
    return Profile("real", os.path.join("examples", "real_cpu", "config.yaml"),
                   [*REAL_SIZES, *paths], [*REAL_SMOKE_SIZES, *paths], server=server)


PROFILES = {"tiny": tiny, "real": real}


def get(name: str, **kwargs) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"--model {name!r}: unknown; known: {sorted(PROFILES)}")
    return PROFILES[name](**kwargs)


__all__ = ["PROFILES", "Profile", "REAL_HF_DIR", "REAL_MCORE_DIR", "get", "real", "tiny"]
