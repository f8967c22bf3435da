"""One API-key type for every engine, the driver and the vLLM launcher: the secret never shows in a
repr, a str, a format, a log line, an exception or a pickle; it leaves only as the bearer header
(or, for a launcher, through `reveal()` into the server's environment)."""

from __future__ import annotations

import logging
import pickle

import pytest
from tiny_lm import VOCAB, TinyLM, prompts
from fake_vllm import FakeVLLMServer

from rollout_bridge import (
    ApiKey,
    EngineMismatchError,
    LocalEngine,
    SGLangEngine,
    VLLMEngine,
    read_api_key,
)
from rollout_bridge.core import apikey as apikey_module

SECRET = "pdm-secret-0123456789abcdef"


def test_the_key_never_prints():
    key = ApiKey(f"  {SECRET}\n")
    for text in (repr(key), str(key), f"{key}", f"{key!r}", f"{key:>40}", "%s %r" % (key, key),
                 repr([key]), repr({"k": key})):
        assert SECRET not in text
    assert key.header() == {"Authorization": f"Bearer {SECRET}"}
    assert key.reveal() == SECRET
    with pytest.raises(TypeError, match="not picklable"):
        pickle.dumps(key)
    assert ApiKey.of(None) is None and ApiKey.of(key) is key and ApiKey.of(SECRET) == key
    with pytest.raises(ValueError, match="empty"):
        ApiKey("  ")


def test_both_engines_and_the_package_use_the_one_type():
    sglang = SGLangEngine("http://127.0.0.1:9", api_key=SECRET)
    vllm = VLLMEngine("http://127.0.0.1:9", api_key=SECRET)
    assert isinstance(sglang.http._api_key, apikey_module.ApiKey)
    assert isinstance(vllm.http._api_key, apikey_module.ApiKey)
    for engine in (sglang, vllm):
        assert engine.has_api_key
        for part in (engine, engine.http, engine.control, engine.weights):
            assert SECRET not in repr(vars(part))
            assert SECRET not in str(vars(part))


def test_read_api_key_from_env_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PDM_TEST_KEY", SECRET)
    assert read_api_key("PDM_TEST_KEY") == ApiKey(SECRET)
    path = tmp_path / "key"
    path.write_text("other-key\n")
    assert read_api_key("PDM_TEST_KEY", str(path)).reveal() == "other-key"
    monkeypatch.delenv("PDM_TEST_KEY")
    assert read_api_key("PDM_TEST_KEY") is None


def test_vllm_key_not_in_logs_or_errors(caplog):
    srv = FakeVLLMServer(LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=5, seed=1,
                                     eos_token_id=3), api_key=SECRET)
    srv.start()
    try:
        caplog.set_level(logging.DEBUG)
        client = VLLMEngine(srv.url, top_logprobs=5, api_key=ApiKey(SECRET), vocab_size=VOCAB,
                            timeout_s=5.0, max_retries=0)
        client.check_server()
        assert not client.generate(prompts(1), {"temperature": 1.0, "max_new_tokens": 4}).failures
        wrong = VLLMEngine(srv.url, top_logprobs=5, api_key=SECRET + "-wrong", timeout_s=5.0)
        with pytest.raises(EngineMismatchError) as info:
            wrong.check_server()
        assert SECRET not in str(info.value) and SECRET not in repr(info.value)
        assert SECRET not in caplog.text
    finally:
        srv.stop()


def test_vllm_launcher_holds_an_api_key(tmp_path):
    from megatron_pdm.train.rollout.vllm_server.process import VLLMServer

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 64}')
    server = VLLMServer(model, tmp_path / "work", api_key=SECRET)
    assert isinstance(server.api_key, ApiKey)
    assert SECRET not in repr(vars(server)) and SECRET not in " ".join(server.command())
    assert server.environment()["VLLM_API_KEY"] == SECRET
    generated = VLLMServer(model, tmp_path / "work2")
    assert len(generated.api_key.reveal()) == 32
