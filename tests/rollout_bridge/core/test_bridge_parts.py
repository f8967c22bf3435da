"""Each engine client is a composition of small parts with explicit constructor arguments: a
transport, a control part and a weight-sync part. A part works on its own, given only what its
constructor names (no attribute set by some subclass), and the engine's methods are the parts'."""

from __future__ import annotations

import inspect

from tiny_lm import VOCAB, TinyLM
from fake_vllm import FakeVLLMServer

from rollout_bridge import LocalEngine, SGLangEngine, VLLMEngine
from rollout_bridge.sglang.control import SGLangControl
from rollout_bridge.sglang.http import SGLangHTTP
from rollout_bridge.sglang.weights import SGLangWeightSync
from rollout_bridge.vllm.control import VLLMControl
from rollout_bridge.vllm.http import VLLMHTTP
from rollout_bridge.vllm.weights import VLLMWeightSync


def test_no_base_class_chains():
    for cls in (SGLangEngine, SGLangHTTP, SGLangControl, SGLangWeightSync, VLLMEngine, VLLMHTTP,
                VLLMControl, VLLMWeightSync):
        assert cls.__mro__[1:] == (object,), cls


def test_sglang_parts_standalone(server):
    http = SGLangHTTP(server.url, control_timeout_s=10)
    control = SGLangControl(http, vocab_size=VOCAB)
    info = control.check_server()
    assert info["num_servers"] == 1 and control.known_version == info["weight_version"]
    sync = SGLangWeightSync(http, control)
    assert sync.flush(None) is True  # pause_mode "abort" flushes by default
    engine = SGLangEngine(server.url, top_logprobs=5, vocab_size=VOCAB)
    assert engine.weights.http is engine.http and engine.control.http is engine.http
    assert engine.check_server()["weight_version"] == info["weight_version"]
    assert inspect.signature(SGLangEngine.update_weights_from_disk) == \
        inspect.signature(SGLangWeightSync.update_weights_from_disk)
    assert SGLangEngine.check_server.__doc__ == SGLangControl.check_server.__doc__


def test_vllm_control_standalone():
    srv = FakeVLLMServer(LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=5, seed=1,
                                     eos_token_id=3), api_key="k")
    srv.start()
    try:
        control = VLLMControl(VLLMHTTP(srv.url, api_key="k", control_timeout_s=10),
                              top_logprobs=5, vocab_size=VOCAB)
        info = control.check_server()
        assert control.model == info["model"] == "pdm-policy"
        assert control.weight_version() == info["weight_version"]
        engine = VLLMEngine(srv.url, top_logprobs=5, api_key="k", vocab_size=VOCAB)
        engine.model = "pdm-policy"  # the engine's attributes are its parts' (read and write)
        assert engine.control.model == "pdm-policy"
        assert engine.weights.control is engine.control
    finally:
        srv.stop()
