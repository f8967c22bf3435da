"""End-to-end runs of `python -m megatron_pdm.train` on 2 CPU processes (gloo).

- TP=2 (sequence parallel) and EP=2 (DP=2, distributed optimizer sharded over DP) short runs:
  the loop completes, metrics.jsonl has one row per optimizer step with the contract keys, all
  finite, and checkpoints + summary are written.
- Resume: an uninterrupted run (inside the RL learning-rate warm-up) vs. a run that is killed
  (SIGKILL to the whole torchrun process group) once its third iteration is logged, then resumed
  with --resume from the newest complete checkpoint. Every non-time metric of every optimizer
  step must be identical (exact float equality: same seed, CPU, same layout), wherever the kill
  landed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

import pytest

from tests.support._launch import ROOT, command, launch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

CONTRACT = ("step", "reward/mean", "pdm/masked_frac", "mismatch/abs_logprob_diff",
            "pdm/topk_kl_mean", "pdm/abs_prob_diff")


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.gloo
@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.ep=1"],
                                    ["parallel.tp=1", "parallel.ep=2"]], ids=["tp2", "ep2"])
def test_short_run(tmp_path, layout):
    out = str(tmp_path / "run")
    launch(out, layout + ["loss.preset=pdm-exact"])
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))  # 4 iterations x 2 minibatches
    for r in rows:
        for key in CONTRACT:
            assert key in r, key
        for key in ("reward/mean", "mismatch/abs_logprob_diff", "pdm/topk_kl_mean"):
            assert r[key] is not None and math.isfinite(r[key])
        assert r["mismatch/abs_logprob_diff"] > 0  # bf16 engine copy differs from training
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["optimizer_steps"] == 8
    assert os.path.exists(os.path.join(out, "checkpoints", "latest"))


def _kill_after_rows(out: str, overrides: list[str], rows: int, timeout: float = 240) -> None:
    """Starts a run and SIGKILLs its whole process group once `rows` metrics rows exist."""
    cmd, env = command(out, overrides)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(path) and len(_rows(out)) >= rows:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        assert len(_rows(out)) >= rows, "the run did not log enough rows in time"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.gloo
def test_resume_after_a_kill_reproduces_uninterrupted_run(tmp_path):
    # the learning-rate warm-up spans every step: a resume must continue it, not restart it
    common = ["checkpoint.save_interval=2", "loss.preset=pdm-agg", "train.iterations=6",
              "train.lr=3e-4", "train.lr_warmup_steps=20"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    launch(full, common)
    assert [r["lr"] for r in _rows(full)] == pytest.approx([3e-4 * k / 20 for k in range(1, 13)])
    _kill_after_rows(part, common, rows=6)  # 3 iterations logged; checkpoint at 2 (or 4)
    assert not os.path.exists(os.path.join(part, "summary.json"))
    launch(part, common, extra=["--resume"])
    a, b = _rows(full), _rows(part)
    assert len(a) == len(b) == 12
    for ra, rb in zip(a, b):
        ka = {k: v for k, v in ra.items() if not k.startswith("time/")}
        kb = {k: v for k, v in rb.items() if not k.startswith("time/")}
        assert ka == kb, (ra["step"], {k: (ka[k], kb.get(k)) for k in ka if ka[k] != kb.get(k)})
    with open(os.path.join(full, "summary.json")) as f:
        sa = json.load(f)
    with open(os.path.join(part, "summary.json")) as f:
        sb = json.load(f)
    for key in ("greedy_acc_before_rl", "greedy_acc_after_rl", "rl_reward_final"):
        assert sa[key] == sb[key], key


@pytest.mark.gloo
def test_no_warmup_with_checkpoints_saves_and_resumes_at_iteration_0(tmp_path):
    """warmup.steps=0 with checkpoints on (the cluster example's combination): the iteration-0
    checkpoint is written before the first optimizer step (megatron's DistributedOptimizer
    cannot describe an empty Adam state without apex/TE: it asserted), and a run resumed from it
    reproduces the uninterrupted run exactly."""
    import shutil

    common = ["warmup.steps=0", "checkpoint.save_interval=1", "checkpoint.keep_last=10",
              "train.iterations=2", "loss.preset=pdm-agg"]
    full, part = tmp_path / "full", tmp_path / "part"
    launch(str(full), common)
    assert (full / "checkpoints" / "iter_0000000").is_dir()
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "iter_0000000", part / "checkpoints" / "iter_0000000")
    (part / "checkpoints" / "latest").write_text("iter_0000000")
    launch(str(part), common, extra=["--resume"])
    a, b = _rows(str(full)), _rows(str(part))
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        assert ({k: v for k, v in ra.items() if not k.startswith("time/")}
                == {k: v for k, v in rb.items() if not k.startswith("time/")}), ra["step"]
