"""The tiny driver with `train.fused_head=true` (TP 2, sequence parallel on): the supervised
warm-up (cross-entropy on `LMHead.logits`) and one RL iteration (the fused op) run, and the
step's metrics are finite, and the train/rollout log-prob mismatch is the bf16 engine's (0.0014
measured) rather than that of hidden states read as logits (1.82 measured with the trainer's head
dropped). Equality with the default path is tests/mcore/test_fused_head_model.py."""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.support._launch import launch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.mark.gloo
def test_short_run_with_the_fused_head(tmp_path):
    out = str(tmp_path / "run")
    proc = launch(out, ["parallel.tp=2", "parallel.ep=1", "train.fused_head=true",
                        "warmup.steps=2", "train.iterations=1",
                        "train.minibatches_per_iteration=1", "checkpoint.save_interval=0"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1], proc.stdout[-2000:]
    for key in ("grad_norm", "mismatch/abs_logprob_diff", "pdm/topk_kl_mean"):
        assert key in rows[0] and math.isfinite(rows[0][key]), key
    diff = rows[0]["mismatch/abs_logprob_diff"]
    print(f"fused head e2e: mismatch/abs_logprob_diff {diff}")
    # > 0: the bf16 engine copy vs the fp32 trainer. Small: the loss applied the LM head to
    # the hidden states (hidden states read as if they were logits give log-probs off by ~1).
    assert 0 < diff < 0.1, diff
