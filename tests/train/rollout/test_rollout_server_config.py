"""Config rules of the server engines: engine=vllm needs its URL, overlap needs a server engine,
and the vLLM launcher refuses shapes and addresses it cannot serve safely."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_pdm.arch import ModelArch
from megatron_pdm.configtree import ConfigError
from megatron_pdm.train.config import RunConfig


def test_vllm_needs_url_and_overlap_needs_a_server():
    with pytest.raises(ConfigError, match="rollout.vllm.url"):
        RunConfig.load(None, ["rollout.engine=vllm"])
    cfg = RunConfig.load(None, ["rollout.engine=vllm", "rollout.vllm.url=http://127.0.0.1:1",
                                "rollout.overlap=true"])
    assert cfg.rollout.overlap and cfg.rollout.vllm.api_key_env == "PDM_VLLM_API_KEY"
    with pytest.raises(ConfigError, match="overlap=true needs a server engine"):
        RunConfig.load(None, ["rollout.overlap=true"])
    with pytest.raises(ConfigError, match="rollout.vllm.restart_wait_s"):
        RunConfig.load(None, ["rollout.engine=vllm", "rollout.vllm.url=http://x:1",
                              "rollout.vllm.restart_wait_s=-1"])


def test_launcher_refusals():
    from megatron_pdm.train.rollout.vllm_server.model_dir import check_servable
    from megatron_pdm.train.rollout.vllm_server.process import check_bind_host

    arch = ModelArch(vocab_size=18, hidden_size=64, num_layers=1, num_attention_heads=4,
                        num_query_groups=2, head_dim=32, num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=64)
    check_servable(arch)
    with pytest.raises(ConfigError, match="head_dim"):
        check_servable(dataclasses.replace(arch, head_dim=16))
    with pytest.raises(ConfigError, match="multiple of 32"):
        check_servable(dataclasses.replace(arch, moe_ffn_hidden_size=48))
    check_bind_host("127.0.0.1")
    check_bind_host("10.1.2.3")
    for bad in ("0.0.0.0", "8.8.8.8", "example.org"):
        with pytest.raises(ValueError):
            check_bind_host(bad)


VLLM = ["rollout.engine=vllm", "rollout.vllm.url=http://127.0.0.1:1"]


@pytest.mark.parametrize("value,match", [
    ("-1", "rollout.vllm.pause_wait_s=-1.0 must be >= 0"),
    ("inf", "rollout.vllm.pause_wait_s=inf must be a finite number"),
    ("nan", "rollout.vllm.pause_wait_s='nan': NaN is not a valid value"),
    ("soon", "rollout.vllm.pause_wait_s='soon': expected a number"),
])
def test_pause_wait_is_checked(value, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.load(None, [*VLLM, f"rollout.vllm.pause_wait_s={value}"])
    assert RunConfig.load(None, VLLM).rollout.vllm.pause_wait_s == 60.0
    assert RunConfig.load(None, [*VLLM, "rollout.vllm.pause_wait_s=0"]).rollout.vllm.pause_wait_s \
        == 0.0


def test_pause_wait_reaches_the_vllm_client():
    import types

    from megatron_pdm.train.rollout.vllm import VLLMGlue

    cfg = RunConfig.load(None, [*VLLM, "rollout.vllm.pause_wait_s=7.5",
                                "rollout.vllm.restart_wait_s=2"])
    glue = VLLMGlue(cfg, types.SimpleNamespace(vocab_size=18))
    client = glue.make_client()  # builds the client only: no request is sent
    assert client.pause_wait_s == 7.5 and client.weights.recover_timeout_s == 2.0
