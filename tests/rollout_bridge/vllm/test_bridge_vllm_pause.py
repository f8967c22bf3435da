"""A paused vLLM server: 0.32 holds new requests until /resume, 0.33 answers them HTTP 503.

The client must not spend retries on (or fail) samples sent while the server is paused; a pause
that outlasts `pause_wait_s` fails the samples with a clear, non-retried error.
"""

from __future__ import annotations

import threading

import pytest
from tiny_lm import VOCAB, TinyLM, prompts
from fake_vllm import FakeVLLMServer

from rollout_bridge import LocalEngine
from rollout_bridge.vllm.client import VLLMEngine

PARAMS = {"temperature": 1.0, "max_new_tokens": 4}
KEY = "k3y"


def _server(pause_rejects: bool) -> FakeVLLMServer:
    engine = LocalEngine(TinyLM(seed=1), vocab_size=VOCAB, top_logprobs=5, seed=1,
                         eos_token_id=3)
    srv = FakeVLLMServer(engine, api_key=KEY, pause_rejects=pause_rejects)
    srv.start()
    return srv


def _client(srv, **kw) -> VLLMEngine:
    args = dict(top_logprobs=5, api_key=KEY, timeout_s=30.0, max_retries=0, backoff_s=0.001,
                backoff_max_s=0.01, vocab_size=VOCAB, seed=3)
    args.update(kw)
    return VLLMEngine(srv.url, **args)


@pytest.mark.parametrize("pause_rejects", [False, True], ids=["0.32-hold", "0.33-503"])
def test_requests_sent_while_paused_wait_for_resume_without_spending_attempts(pause_rejects):
    srv = _server(pause_rejects)
    try:
        client = _client(srv)
        client.check_server()
        srv.paused = True
        resumed = threading.Event()

        def resume():
            srv.paused = False
            resumed.set()

        timer = threading.Timer(0.5, resume)
        timer.start()
        batch = client.generate(prompts(3), PARAMS, n=2)
        timer.join()
        assert resumed.is_set()
        assert not batch.failures  # max_retries=0: a 503 counted as an attempt would fail
        assert len(batch.samples) == 6
        assert all(s.meta_info["attempts"] == 1 for s in batch.samples)
        if pause_rejects:
            assert any(name == "completions" for name, _ in srv.calls)
    finally:
        srv.stop()


def test_paused_by_someone_else_for_too_long_fails_clearly():
    srv = _server(pause_rejects=True)
    try:
        client = _client(srv, max_retries=3, pause_wait_s=0.3)
        client.check_server()
        srv.paused = True
        batch = client.generate(prompts(2), PARAMS, n=2)
        assert not batch.samples and len(batch.failures) == 4
        for f in batch.failures:
            assert f.kind == "paused" and f.attempts == 1  # not retried
            assert srv.url in f.error and "pause_wait_s" in f.error
    finally:
        srv.stop()


# ------------------------------------------------------------- return_weight_versions (vLLM 0.33)

def test_weight_versions_used_where_the_server_reports_them():
    srv = _server(pause_rejects=True)
    srv.weight_versions = True
    try:
        client = _client(srv)
        batch = client.generate(prompts(2), PARAMS, n=2)
        assert not batch.failures and client.weight_versions_supported is True
        for s in batch.samples:
            assert s.meta_info["weight_versions"] == [
                {"version": "default", "start": 0, "end": s.num_tokens}]
        srv.span_version = "other"  # a sample drawn by weights the client did not expect
        bad = client.generate(prompts(2), PARAMS, n=2)
        assert not bad.samples and {f.kind for f in bad.failures} == {"version"}
        assert all("'other'" in f.error and f.attempts == 1 for f in bad.failures)
    finally:
        srv.stop()


def test_weight_versions_not_sent_again_to_a_server_that_ignores_them():
    srv = _server(pause_rejects=False)  # 0.32: the field is accepted and ignored
    try:
        client = _client(srv)
        client.generate(prompts(2), PARAMS, n=1)
        assert client.weight_versions_supported is False
        client.generate(prompts(2), PARAMS, n=1)
        bodies = [b for name, b in srv.calls if name == "completions"]
        assert bodies[0]["return_weight_versions"] is True
        assert "return_weight_versions" not in bodies[-1]
    finally:
        srv.stop()
