"""The driver's rollout saver (train/rollout/store.py): bounded, lossless, plain-data files."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megatron_pdm.train.rollout import store as rollout_store
from megatron_pdm.train.config import RunConfig
from rollout_bridge.core.packing import pack_padded
from rollout_bridge.core.types import RolloutBatch, RolloutSample, group_advantages

V, K = 11, 3


def _batch(seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, t) in enumerate([(3, 4), (2, 1), (4, 3)]):
        lp = torch.log_softmax(torch.randn(t, V, generator=g), -1)
        ids = torch.zeros(t, K + 1, dtype=torch.int32)
        lps = torch.full((t, K + 1), -math.inf)
        valid = torch.zeros(t, K + 1, dtype=torch.bool)
        top_v, top_i = torch.topk(lp, K, dim=-1)
        ids[:, :K], lps[:, :K], valid[:, :K] = top_i.int(), top_v, True
        resp = top_i[:, 0]
        samples.append(RolloutSample(
            prompt_ids=torch.randint(0, V, (p,), generator=g), response_ids=resp.long(),
            behavior_logprob=top_v[:, 0], support_ids=ids, support_logprobs=lps,
            support_valid=valid, finish_reason="stop", prompt_index=i // 2, group_index=i // 2,
            sample_index=i % 2, reward=float(i % 2), meta_info={"weight_version": "4"}))
    return RolloutBatch(samples=samples, temperature=0.8, weight_version="4", top_logprobs=K,
                        n=2, num_prompts=2, vocab_size=V, validated=True)


def _cfg(tmp_path, keep: int) -> RunConfig:
    return RunConfig.load(None, [f"output_dir={tmp_path}", f"log.save_rollouts={keep}"])


def test_round_trip_is_lossless(tmp_path):
    batch = _batch(0)
    path = rollout_store.save_rollout(_cfg(tmp_path, 2), 4, batch)
    loaded, iteration, config = rollout_store.load_rollout(path)
    assert iteration == 4 and config["log"]["save_rollouts"] == 2
    for name in ("temperature", "weight_version", "top_logprobs", "n", "num_prompts",
                 "vocab_size", "validated"):
        assert getattr(loaded, name) == getattr(batch, name), name
    for a, b in zip(batch.samples, loaded.samples, strict=True):
        for name in ("prompt_ids", "response_ids", "behavior_logprob", "support_ids",
                     "support_logprobs", "support_valid", "loss_mask"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert getattr(a, name).dtype == getattr(b, name).dtype, name
        for name in ("finish_reason", "prompt_index", "group_index", "sample_index", "reward",
                     "weight_version"):
            assert getattr(a, name) == getattr(b, name), name
    pa = pack_padded(batch, group_advantages(batch), pad_id=0)
    pb = pack_padded(loaded, group_advantages(loaded), pad_id=0)
    for name, value in pa.flat().items():
        assert torch.equal(value, pb.flat()[name]), name


def test_keeps_only_the_newest_and_is_off_by_default(tmp_path):
    assert rollout_store.save_rollout(_cfg(tmp_path, 0), 0, _batch(0)) is None
    assert not os.path.exists(rollout_store.rollout_dir(str(tmp_path)))
    cfg = _cfg(tmp_path, 2)
    for it in range(5):
        rollout_store.save_rollout(cfg, it, _batch(it))
    saved = rollout_store.list_rollouts(rollout_store.rollout_dir(str(tmp_path)))
    assert [it for it, _ in saved] == [3, 4]
    assert sorted(os.listdir(rollout_store.rollout_dir(str(tmp_path)))) == [
        "rollout_0000003.pt", "rollout_0000004.pt"]


def test_unscored_batch_and_foreign_file_are_refused(tmp_path):
    batch = _batch(0)
    batch.samples[1].reward = None
    with pytest.raises(ValueError, match="iteration 7: samples \\[1\\] have no reward"):
        rollout_store.save_rollout(_cfg(tmp_path, 1), 7, batch)
    other = tmp_path / "x.pt"
    torch.save({"format": "something else"}, other)
    with pytest.raises(ValueError, match="not a saved rollout batch"):
        rollout_store.load_rollout(str(other))


def test_negative_keep_is_a_config_error():
    from megatron_pdm.configtree import ConfigError

    with pytest.raises(ConfigError, match="log.save_rollouts"):
        RunConfig.load(None, ["log.save_rollouts=-1"])
