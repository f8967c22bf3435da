"""The rollout config is nested per engine (`rollout.sglang`, `rollout.vllm`,
`rollout.weight_sync`); every flat key of the earlier layout is refused with its new place."""

from __future__ import annotations

import pytest
import yaml

from megatron_pdm.configtree import ConfigError
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.rollout.config import (
    ROLLOUT_MOVED_KEYS,
    RolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
    WeightSyncConfig,
)

OLD_VALUES = {"sglang_url": "http://x:1", "sglang_urls": ["http://x:1"],
              "sglang_api_key_env": "K", "sglang_api_key_file": "/k",
              "weight_sync_backend": "gloo", "weight_sync_master_addr": "10.0.0.1",
              "weight_sync_master_port": 1234, "weight_sync_bucket_mb": 8,
              "weight_sync_load_format": "per_tensor", "weight_sync_digest": True,
              "vllm_url": "http://x:2", "vllm_api_key_env": "V",
              "vllm_allow_insecure_dev_routes": True, "vllm_restart_wait_s": 5.0}


@pytest.mark.parametrize("old", sorted(ROLLOUT_MOVED_KEYS))
def test_a_flat_key_names_its_new_place(old, tmp_path):
    new = ROLLOUT_MOVED_KEYS[old]
    with pytest.raises(ConfigError, match=rf"rollout\.{old} moved to rollout\.{new}"):
        RunConfig.load(None, [f"rollout.{old}={OLD_VALUES[old]}"])
    # the same from a yaml file, and the new key takes the value
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"rollout": {old: OLD_VALUES[old]}}))
    with pytest.raises(ConfigError, match=rf"rollout\.{new}"):
        RunConfig.load(str(path))
    section, key = new.split(".")
    cfg = RunConfig.load(None, [f"rollout.{new}={OLD_VALUES[old]}"])
    assert getattr(getattr(cfg.rollout, section), key) == OLD_VALUES[old]


def test_weight_sync_string_names_the_mode_key():
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.mode=distributed"):
        RunConfig.load(None, ["rollout.weight_sync=distributed"])


def test_sections_parse_and_check(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"rollout": {
        "engine": "sglang", "sglang": {"urls": ["http://a:1", "http://b:1"]},
        "weight_sync": {"mode": "distributed", "backend": "gloo", "bucket_mb": 4}}}))
    cfg = RunConfig.load(str(path))
    assert cfg.rollout.sglang.urls == ["http://a:1", "http://b:1"]
    assert (cfg.rollout.weight_sync.mode, cfg.rollout.weight_sync.backend) == ("distributed",
                                                                              "gloo")
    assert cfg.rollout.vllm == VLLMRolloutConfig()
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.bucket_mb"):
        RunConfig.load(None, ["rollout.weight_sync.bucket_mb=0"])
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.mode"):
        RunConfig.load(None, ["rollout.weight_sync.mode=nfs"])
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['rollout\.sglang\.uri'\]"):
        RunConfig.load(None, ["rollout.sglang.uri=http://x:1"])
    with pytest.raises(ConfigError, match="exclusive"):
        RunConfig.load(None, ["rollout.sglang.url=http://x:1", "rollout.sglang.urls=[http://y:1]"])
    with pytest.raises(ConfigError, match=r"needs rollout\.sglang\.url"):
        RolloutConfig(engine="sglang", hf_checkpoint="/x")
    built = RolloutConfig(engine="sglang", sglang=SGLangRolloutConfig(url="http://x:1"),
                          weight_sync=WeightSyncConfig(mode="distributed"))
    assert built.weight_sync.master_port == 0
