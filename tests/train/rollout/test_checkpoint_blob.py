"""The overlap batch in a checkpoint's train_state holds plain containers only and is read with
weights_only=True (train/rollout/store.py encode_batch / decode_batch via
train/rollout/feed.py decode_ready)."""

from __future__ import annotations

import io
import os

import pytest
import torch

from megatron_pdm.train.rollout.feed import decode_ready as _decode_ready
from megatron_pdm.train.rollout.feed import encode_ready as _encode_ready
from rollout_bridge.core.types import RolloutBatch, RolloutFailure, RolloutSample


def _sample(i):
    return RolloutSample(prompt_ids=torch.tensor([1, 2, 3]), response_ids=torch.tensor([4, 5]),
                         behavior_logprob=torch.tensor([-0.5, -0.25]),
                         support_ids=torch.tensor([[4, 6], [5, 7]], dtype=torch.int32),
                         support_logprobs=torch.tensor([[-0.5, -1.0], [-0.25, float("-inf")]]),
                         support_valid=torch.tensor([[True, True], [True, False]]),
                         finish_reason="stop", loss_mask=torch.tensor([True, True]),
                         prompt_index=i, group_index=i, sample_index=0,
                         meta_info={"weight_version": "3"})


def test_overlap_batch_round_trips_without_pickle():
    batch = RolloutBatch(samples=[_sample(0), _sample(1)], temperature=0.7, weight_version="3",
                         top_logprobs=1, n=1, num_prompts=3, vocab_size=17, validated=True,
                         failures=[RolloutFailure(2, 0, 3, "timed out", "timeout")])
    problems, back = _decode_ready(_encode_ready(([(1, 2), (3, 4), (5, 6)], batch)))
    assert [tuple(p) for p in problems] == [(1, 2), (3, 4), (5, 6)]
    assert back.failures == batch.failures and back.weight_version == "3"
    for a, b in zip(batch.samples, back.samples):
        assert torch.equal(a.support_ids, b.support_ids) and a.prompt_index == b.prompt_index
        assert b.weight_version == "3"


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickled_object_in_the_blob_is_refused():
    buf = io.BytesIO()
    torch.save({"format": "megatron_pdm.rollout/1", "x": _Payload()}, buf)
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        _decode_ready(buf.getvalue())
