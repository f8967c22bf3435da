"""SIGKILL (every rank and torchrun) at each phase of a checkpoint save, then --resume: the run
ends with metrics equal (except time/*) to an uninterrupted run. The phases are reached
deterministically through the test hook `PDM_TEST_KILL_AT_SAVE_PHASE=<phase>@<iteration>`
(train/resume.py); the last two kills hit the final re-save of a run resumed at its end."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_pdm.train.resume import KILL_ENV
from tests.support._launch import ROOT, command, launch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

COMMON = ["checkpoint.save_interval=1", "checkpoint.keep_last=2", "train.iterations=2",
          "loss.preset=pdm-agg"]


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
                for line in f]


def _killed(out: str, spec: str, resume: bool) -> None:
    cmd, env = command(out, COMMON, ["--resume"] if resume else [])
    env[KILL_ENV] = spec
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
                          start_new_session=True)
    assert proc.returncode != 0, f"{spec}: the run was not killed\n{proc.stderr[-3000:]}"


@pytest.mark.gloo
def test_kill_at_every_save_phase_then_resume_reproduces_the_run(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    launch(full, COMMON)
    kills = ["tmp@1", "written@1", "manifest@1", "renamed@1", "latest@2"]
    for i, spec in enumerate(kills):
        _killed(part, spec, resume=i > 0)
    launch(part, COMMON, extra=["--resume"])  # runs to the end (final save of iteration 2)
    for spec in ("moved_aside@2", "renamed@2"):  # the final re-save of a run resumed at its end
        _killed(part, spec, resume=True)
    launch(part, COMMON, extra=["--resume"])
    assert _rows(part) == _rows(full)
    ckpts = sorted(n for n in os.listdir(os.path.join(part, "checkpoints"))
                   if n.startswith("iter_") or n.startswith(".iter_"))
    assert ckpts == ["iter_0000001", "iter_0000002"], ckpts
    with open(os.path.join(full, "summary.json")) as f:
        sa = json.load(f)
    with open(os.path.join(part, "summary.json")) as f:
        sb = json.load(f)
    for key in ("greedy_acc_before_rl", "greedy_acc_after_rl", "rl_reward_final"):
        assert sa[key] == sb[key], key
