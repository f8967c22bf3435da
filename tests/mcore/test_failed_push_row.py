"""A weight push that fails after an iteration's optimizer steps still logs every step's row.

The iteration's last metrics row waits for the push's time (`time/weight_sync_s`,
`time/iteration_s`). When the push (or the overlapped rollout collected before it) raises, the
row is written anyway with those two times null, and the error propagates: the log never reads
as a batch trained on fewer minibatches than it was (a real vLLM server killed at the push did
exactly that, tests/train/rollout/test_vllm_faults.py). The successful iteration before it has both
times.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests.support._dist import run_gloo

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml")


class _PushRefused(RuntimeError):
    pass


def _worker(rank, world, out):
    from megatron.core import parallel_state

    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.logging_utils import MetricsWriter
    from megatron_pdm.train.trainer import Trainer

    cfg = RunConfig.load(TINY, [
        "rollout.prompts_per_iteration=2", "rollout.group_size=2",
        "train.minibatches_per_iteration=2", "train.eval_prompts=2", "train.iterations=2",
        "parallel.tp=1", "warmup.steps=0", f"output_dir={out}", "log.tensorboard=false", "log.plot=false",
        "log.progress=false"])
    try:
        tr = Trainer(cfg)
        tr.sync_weights()
        writer = MetricsWriter(out, resume_step=None, tensorboard=False)
        tr.rl_iteration(writer)

        def refuse():
            raise _PushRefused("the server refused the push")

        tr.sync_weights = refuse
        with pytest.raises(_PushRefused):
            tr.rl_iteration(writer)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gloo
@pytest.mark.megatron
def test_failed_push_still_logs_the_last_step(tmp_path):
    out = str(tmp_path / "run")
    run_gloo(_worker, 1, out)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["iteration"], r["minibatch"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    ok, failed = rows[1], rows[3]
    assert ok["time/weight_sync_s"] >= 0 and ok["time/iteration_s"] > 0
    assert failed["time/weight_sync_s"] is None and failed["time/iteration_s"] is None
    assert all(r["rollout/num_samples"] == 4 for r in rows)
