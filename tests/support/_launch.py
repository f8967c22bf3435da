"""Launch the trainer CLI under torchrun for the end-to-end tests (2 processes, one machine)."""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_pdm.netutil import LOCAL_TORCHRUN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "examples", "tiny_cpu", "config.yaml")

# Short run: small warm-up, few iterations, small batches.
SHORT = [
    "warmup.steps=10", "warmup.batch_size=16", "train.iterations=4",
    "train.minibatches_per_iteration=2", "rollout.prompts_per_iteration=4",
    "rollout.group_size=4", "train.eval_prompts=16", "log.plot=false", "log.progress=false",
    "log.tensorboard=false",
]


def command(output_dir: str, overrides: list[str], extra: list[str] = (),
            nproc: int = 2) -> tuple[list[str], dict]:
    """The torchrun command line and environment of a short trainer run."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", str(nproc), *LOCAL_TORCHRUN,
           "-m", "megatron_pdm.train", "--config", CONFIG, "--output-dir", output_dir]
    for item in SHORT + list(overrides):
        cmd += ["--set", item]
    cmd += list(extra)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return cmd, env


def launch(output_dir: str, overrides: list[str], *, extra: list[str] = (), nproc: int = 2,
           timeout: int = 240) -> subprocess.CompletedProcess:
    cmd, env = command(output_dir, overrides, extra, nproc)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc
