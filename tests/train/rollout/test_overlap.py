"""`rollout.overlap` with SGLang (fake server over transformers, as in test_train_sglang.py).

One overlapped run (TP=2, 4 iterations, checkpoints every 2): batch 0 is generated synchronously
with the initial weights (staleness 0), every later batch is generated during the previous
iteration's training with the weights that batch came from (weight versions 0, 0, 1, 2;
staleness 0, 1, 1, 1); every requested sample arrives (the loss sees the whole batch); each
weight push happens with no generation in flight (pause -> update -> continue). Then the run is
resumed from its iteration-2 checkpoint, which holds the collected, not yet trained batch of
iteration 2: the resumed run reproduces the uninterrupted run's metrics exactly.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.support._launch import launch
from tests.train.rollout.test_train_sglang import _Server, converted  # noqa: F401 (fixture)

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

COMMON = ["parallel.tp=2", "parallel.ep=1", "rollout.engine=sglang", "rollout.overlap=true",
          "rollout.max_sequence_length=16", "rollout.rollout_precision=null",
          "rollout.sync_at_start=false", "task.partial_credit=true", "warmup.steps=0",
          "train.iterations=4", "loss.preset=pdm-exact", "checkpoint.save_interval=2",
          "checkpoint.keep_last=10", "train.eval_prompts=4"]


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _run(work, checkpoints, extra=(), out=None):
    hf, mcore = checkpoints
    server = _Server(hf, str(work))
    out = out or str(work / "run")
    try:
        launch(out, COMMON + [f"checkpoint.load_dir={mcore}", "checkpoint.arch_from_load_dir=true",
                              f"rollout.sglang.url={server.url}",
                              f"rollout.sglang.hf_checkpoint={work / 'sync'}"],
               extra=list(extra), timeout=420)
        calls = server.calls()
    finally:
        server.stop()
    return out, calls


@pytest.mark.gloo
def test_overlap_staleness_versions_and_exact_resume(tmp_path, converted):  # noqa: F811
    (tmp_path / "full").mkdir()
    full, calls = _run(tmp_path / "full", converted)
    rows = _rows(full)
    assert [r["step"] for r in rows] == list(range(1, 9))  # 4 iterations x 2 minibatches
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [r["rollout/staleness"] for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
    # no sample lost: 4 prompts x 4 samples scored in every iteration (partial credit: the
    # reward mean is a multiple of 1/(16 * answer length))
    assert all(r["tokens/loss"] > 0 for r in rows)
    names = [c["call"] for c in calls]
    updates = [i for i, n in enumerate(names) if n == "update_weights_from_disk"]
    assert len(updates) == 4  # one push per iteration (no initial push: sync_at_start=false)
    for i in updates:
        assert names[i - 1] == "pause_generation" and names[i + 1] == "continue_generation"
    # step 1 is on-policy (server = HF weights, trainer = converted weights); later first
    # minibatches are one update behind, so they differ more than fp32 noise
    assert rows[0]["mismatch/abs_logprob_diff"] < 1e-4
    assert rows[2]["mismatch/abs_logprob_diff"] > 10 * rows[0]["mismatch/abs_logprob_diff"]

    # resume from the iteration-2 checkpoint (it holds batch 2, generated with version 1)
    (tmp_path / "part").mkdir()
    part = tmp_path / "part" / "run"
    (part / "checkpoints").mkdir(parents=True)
    src = os.path.join(full, "checkpoints", "iter_0000002")
    shutil.copytree(src, part / "checkpoints" / "iter_0000002")
    (part / "checkpoints" / "latest").write_text("iter_0000002")
    _run(tmp_path / "part", converted, extra=["--resume"], out=str(part))
    resumed = _rows(str(part))
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for ra, rb in zip(rows[4:], resumed):
        ka = {k: v for k, v in ra.items() if not k.startswith("time/")}
        kb = {k: v for k, v in rb.items() if not k.startswith("time/")}
        assert ka == kb, (ra["step"], {k: (ka[k], kb.get(k)) for k in ka if ka[k] != kb.get(k)})
