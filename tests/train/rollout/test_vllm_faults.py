"""Check 3: the vLLM server dies mid-run (SIGKILL of its whole process group = a crash).

1. Restarted (same address, its on-disk random weights, version "default") while the trainer
   runs with `rollout.overlap=true` and `rollout.vllm.restart_wait_s`: the client notices the
   restart (connection errors, then a weight version it did not push), re-pushes the cached
   last weights (digest-checked), re-draws the lost samples with their own seeds, and the run
   completes with every sample of every iteration; a push that hit the dead server is repeated.
2. Killed for good with `rollout.vllm.restart_wait_s=0`: the run stops within seconds with an error
   naming the server and the call that failed (whichever call the kill hit first: a rollout,
   a health check, the weight-version check, the push), never training on a partial batch.

This module kills the session's server: it runs last (marker kills_vllm_server), and
`ensure_up` restarts it for anything after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.support._launch import ROOT
from tests.support.vllm_common import rows, trainer_process, vllm_overrides
from tests.support.vllm_failure import check_no_lost_or_duplicated_sample, clear_server_failure
from tests.support.vllm_server import START_TIMEOUT_S

pytestmark = [pytest.mark.vllm_server, pytest.mark.kills_vllm_server, pytest.mark.megatron,
              pytest.mark.slow]

ITERATIONS = 6
PROMPTS, GROUP = 8, 4


def _start(served, out, extra):
    cmd, env = trainer_process(served, out, vllm_overrides(served) + [
        "parallel.tp=2", "parallel.ep=1", f"train.iterations={ITERATIONS}",
        "train.minibatches_per_iteration=2", f"rollout.prompts_per_iteration={PROMPTS}",
        f"rollout.group_size={GROUP}", "task.partial_credit=true", "warmup.steps=0",
        "checkpoint.save_interval=0", "train.eval_prompts=8"] + extra)
    log = open(os.path.join(os.path.dirname(out), "trainer.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log


def _wait_rows(proc, out, n, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if len(rows(out)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"run did not log {n} rows (rc {proc.poll()})")


def _finish(proc, timeout):
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.mark.gloo
def test_server_restarted_mid_run_the_run_completes(vllm_server, tmp_path):
    out = str(tmp_path / "run")
    proc, log = _start(vllm_server, out, ["rollout.overlap=true",
                                          f"rollout.vllm.restart_wait_s={START_TIMEOUT_S}"])
    try:
        _wait_rows(proc, out, 2 * 2, timeout=600)  # two iterations trained
        vllm_server.server.kill()
        t_kill = time.time()
        vllm_server.server.start()
        restart_s = vllm_server.server.wait_ready(START_TIMEOUT_S)
        rc = _finish(proc, timeout=START_TIMEOUT_S + 600)
    finally:
        log.close()
    text = open(os.path.join(tmp_path, "trainer.log")).read()
    assert rc == 0, text[-6000:]
    print(f"\nserver restarted in {restart_s:.0f} s; run finished "
          f"{time.time() - t_kill:.0f} s after the kill")
    metrics = rows(out)
    assert sorted({r["iteration"] for r in metrics}) == list(range(ITERATIONS))
    assert all(r["rollout/num_samples"] == PROMPTS * GROUP for r in metrics)
    # the restart was noticed and repaired by a re-push (not silently rolled out on the
    # server's on-disk weights)
    assert "restarted" in text or "pushing version" in text, text[-4000:]
    assert vllm_server.engine().weight_version() == str(ITERATIONS)


@pytest.mark.gloo
def test_server_killed_for_good_the_run_fails_clearly(vllm_server, tmp_path):
    out = str(tmp_path / "run")
    proc, log = _start(vllm_server, out, ["rollout.vllm.restart_wait_s=0",
                                          "rollout.max_retries=2"])
    try:
        _wait_rows(proc, out, 2, timeout=600)
        vllm_server.server.kill()
        t_kill = time.time()
        rc = _finish(proc, timeout=300)
    finally:
        log.close()
    took = time.time() - t_kill
    text = open(os.path.join(tmp_path, "trainer.log")).read()
    assert rc != 0, text[-4000:]
    # Where the kill lands decides which call fails first (a rollout request, the restart
    # guard's health check, the weight-version check after the rollouts, the weight push): each
    # is a correct failure, so the checks are on what matters, not on one phrasing.
    error = clear_server_failure(text, vllm_server.url)
    print(f"\nrun failed {took:.0f} s after the kill: {error[:300]}")
    check_no_lost_or_duplicated_sample(rows(out), samples=PROMPTS * GROUP, minibatches=2,
                                       iterations=ITERATIONS)
