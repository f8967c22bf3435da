"""Helpers of the real-vLLM tests: trainer runs against the session's server."""

from __future__ import annotations

import json
import os
import subprocess

from tests.support._launch import ROOT, command
from tests.support.vllm_server import KEY_ENV, MODEL_OVERRIDES


def vllm_overrides(served, *, precision: str = "null") -> list[str]:
    """Trainer overrides for a run against the served tiny model."""
    return MODEL_OVERRIDES + [
        "rollout.engine=vllm", f"rollout.vllm.url={served.url}",
        f"rollout.vllm.api_key_env={KEY_ENV}", f"rollout.rollout_precision={precision}",
        "log.plot=false", "log.tensorboard=false", "log.progress=false"]


def trainer_process(served, output_dir: str, overrides: list[str], *, nproc: int = 2
                    ) -> tuple[list[str], dict]:
    cmd, env = command(output_dir, overrides, nproc=nproc)
    env.update(served.env())
    return cmd, env


def run_trainer(served, output_dir: str, overrides: list[str], *, timeout: int = 900
                ) -> subprocess.CompletedProcess:
    cmd, env = trainer_process(served, output_dir, overrides)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


def rows(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def first_rows(metrics: list[dict]) -> list[dict]:
    """The first-minibatch row of each iteration (on-policy w.r.t. the pushed weights)."""
    return [r for r in metrics if r["minibatch"] == 0]
