"""The rollout config is nested per engine: a key one engine alone reads lives in that engine's
section (`rollout.local`, `rollout.sglang` with `rollout.sglang.weight_sync`, `rollout.vllm`);
the top level keeps the keys every engine or both server engines read. A moved key is accepted
at its new place only: at the old one it is an unknown key, and the error names its new place."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from megatron_pdm.configtree import ConfigError
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.rollout.config import (
    LocalRolloutConfig,
    RolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
    WeightSyncConfig,
)

# old key (under rollout.) -> (new key under rollout., a value other than the default)
MOVED = {
    "weight_sync.mode": ("sglang.weight_sync.mode", "distributed"),
    "weight_sync.backend": ("sglang.weight_sync.backend", "gloo"),
    "weight_sync.master_addr": ("sglang.weight_sync.master_addr", "10.0.0.1"),
    "weight_sync.master_port": ("sglang.weight_sync.master_port", 1234),
    "weight_sync.bucket_mb": ("sglang.weight_sync.bucket_mb", 8),
    "weight_sync.load_format": ("sglang.weight_sync.load_format", "per_tensor"),
    "weight_sync.digest": ("sglang.weight_sync.digest", True),
    "hf_checkpoint": ("sglang.hf_checkpoint", "/sync"),
    "topk_transport": ("sglang.topk_transport", "flat_b64"),
    "keep_synced": ("sglang.keep_synced", 5),
    "fp8_scales": ("local.fp8_scales", "block128"),
    "staleness": ("local.staleness", 2),
}


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _nested(dotted: str, value) -> dict:
    out: dict = {}
    node = out
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_key_is_read_at_its_new_place(old, tmp_path):
    new, value = MOVED[old]
    assert _get(RunConfig(), f"rollout.{new}") != value  # the test value is not the default
    cfg = RunConfig.load(None, [f"rollout.{new}={value}"])
    assert _get(cfg.rollout, new) == value
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump({"rollout": _nested(new, value)}))
    assert _get(RunConfig.load(str(path)).rollout, new) == value


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_key_is_refused_at_its_old_place(old, tmp_path):
    new, value = MOVED[old]
    old_top = old.split(".")[0]  # the key the rollout section sees: weight_sync, staleness, ...
    new_top = new[:len(new) - len(old)] + old_top  # its place now: sglang.weight_sync, ...
    # the unknown key is named, and so is its place now (configtree's nested-key guess)
    expect = (rf"unknown key\(s\) \['rollout\.{old_top}'\].*"
              rf"did you mean {re.escape('rollout.' + new_top)}\?")
    with pytest.raises(ConfigError, match=expect):
        RunConfig.load(None, [f"rollout.{old}={value}"])
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"rollout": _nested(old, value)}))
    with pytest.raises(ConfigError, match=expect):
        RunConfig.load(str(path))


def test_top_level_keeps_only_the_shared_keys():
    top = {f.name for f in dataclasses.fields(RolloutConfig)}
    assert top == {"prompts_per_iteration", "group_size", "temperature", "top_logprobs",
                   "rollout_precision", "engine", "local", "sglang", "vllm",
                   "max_sequence_length", "max_new_tokens", "sync_at_start", "timeout_s",
                   "max_retries", "overlap"}
    assert {f.name for f in dataclasses.fields(LocalRolloutConfig)} == {"fp8_scales",
                                                                        "staleness"}
    assert {"weight_sync", "hf_checkpoint", "topk_transport", "keep_synced"} <= {
        f.name for f in dataclasses.fields(SGLangRolloutConfig)}


def test_cross_key_errors_name_the_new_paths():
    with pytest.raises(ConfigError, match=r"^rollout\.local\.staleness=2 needs "
                                          r"rollout\.engine=local"):
        RunConfig.load(None, ["rollout.local.staleness=2", "rollout.engine=vllm",
                              "rollout.vllm.url=http://x:1"])
    with pytest.raises(ConfigError, match=r"rollout\.engine=sglang needs "
                                          r"rollout\.sglang\.hf_checkpoint \(or "
                                          r"rollout\.sglang\.weight_sync\.mode=distributed\)$"):
        RunConfig.load(None, ["rollout.engine=sglang", "rollout.sglang.url=http://x:1"])
    with pytest.raises(ConfigError, match=r"needs rollout\.sglang\.url \(or "
                                          r"rollout\.sglang\.urls\)$"):
        RolloutConfig(engine="sglang", sglang=SGLangRolloutConfig(hf_checkpoint="/x"))
    # either place for the weights satisfies it
    RunConfig.load(None, ["rollout.engine=sglang", "rollout.sglang.url=http://x:1",
                          "rollout.sglang.hf_checkpoint=/x"])
    RunConfig.load(None, ["rollout.engine=sglang", "rollout.sglang.url=http://x:1",
                          "rollout.sglang.weight_sync.mode=distributed"])


def test_sections_check_their_own_values():
    for override, message in [
            ("rollout.sglang.weight_sync.bucket_mb=0",
             r"^rollout\.sglang\.weight_sync\.bucket_mb=0 must be > 0"),
            ("rollout.sglang.weight_sync.mode=nfs", r"^rollout\.sglang\.weight_sync\.mode='nfs'"),
            ("rollout.sglang.keep_synced=0", r"^rollout\.sglang\.keep_synced=0 must be > 0"),
            ("rollout.sglang.topk_transport=xml", r"^rollout\.sglang\.topk_transport='xml'"),
            ("rollout.local.staleness=-1", r"^rollout\.local\.staleness=-1 must be >= 0"),
            ("rollout.local.fp8_scales=block64", r"^rollout\.local\.fp8_scales='block64'")]:
        with pytest.raises(ConfigError, match=message):
            RunConfig.load(None, [override])
    # built in Python, each section checks itself the same way
    with pytest.raises(ConfigError, match=r"rollout\.local\.staleness=-1"):
        LocalRolloutConfig(staleness=-1)
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.keep_synced=0"):
        SGLangRolloutConfig(keep_synced=0)


def test_sections_parse_and_check(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"rollout": {
        "engine": "sglang", "sglang": {"urls": ["http://a:1", "http://b:1"], "weight_sync": {
            "mode": "distributed", "backend": "gloo", "bucket_mb": 4}}}}))
    cfg = RunConfig.load(str(path))
    assert cfg.rollout.sglang.urls == ["http://a:1", "http://b:1"]
    ws = cfg.rollout.sglang.weight_sync
    assert (ws.mode, ws.backend, ws.bucket_mb) == ("distributed", "gloo", 4)
    assert cfg.rollout.vllm == VLLMRolloutConfig()
    assert cfg.rollout.local == LocalRolloutConfig()
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['rollout\.sglang\.uri'\]"):
        RunConfig.load(None, ["rollout.sglang.uri=http://x:1"])
    with pytest.raises(ConfigError, match="exclusive"):
        RunConfig.load(None, ["rollout.sglang.url=http://x:1", "rollout.sglang.urls=[http://y:1]"])
    built = RolloutConfig(engine="sglang", sglang=SGLangRolloutConfig(
        url="http://x:1", weight_sync=WeightSyncConfig(mode="distributed")))
    assert built.sglang.weight_sync.master_port == 0
