"""VLLMEngine against the real vLLM server: start-up checks, the API-key guard on every route,
rollouts with token ids and top-K, a weight push with its digest."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

pytestmark = [pytest.mark.vllm_server, pytest.mark.slow]


def _status(url: str, path: str, key: str | None, body: dict | None = None) -> int:
    req = urllib.request.Request(url + path, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_every_route_needs_the_key(vllm_server):
    url, key = vllm_server.url, vllm_server.key
    assert vllm_server.server.host == "127.0.0.1"
    # vLLM's --api-key alone guards only /v1, /v2, /inference, /cohere; the middleware the
    # launcher loads guards the dev routes too (weight pushes run worker code)
    for path, body in (("/v1/models", None), ("/is_paused", None), ("/weight_info", None),
                       ("/server_info", None), ("/metrics", None),
                       ("/collective_rpc", {"method": "pdm_server_facts"}),
                       ("/update_weight_version", {"new_version": "x"})):
        assert _status(url, path, None, body) == 401, path
        assert _status(url, path, "wrong-key", body) == 401, path
    assert _status(url, "/health", None) == 200
    assert _status(url, "/is_paused", key) == 200


def test_check_generate_and_push(vllm_server):
    from safetensors.torch import load_file

    engine = vllm_server.engine()
    info = engine.check_server()
    facts = info["facts"][0]
    assert info["dev_routes_guarded"] is True
    assert facts["logprobs_mode"] == "processed_logprobs" and facts["dtype"] == "torch.float32"
    assert facts["vocab_size"] == vllm_server.arch.vocab_size
    weights = load_file(str(vllm_server.work / "model" / "model.safetensors"))
    engine.update_weights(weights, "engine-test")
    push = engine.last_push_info
    assert push["worker"][0]["canonical_digest"] == push["digest"]
    assert push["worker"][0]["moe_repacked"]  # the 0.32.0 CPU MoE reload fix ran
    batch = engine.generate([[1, 5, 6, 14, 3, 4, 15]] * 3, {"temperature": 1.0,
                                                             "max_new_tokens": 4,
                                                             "stop_token_ids": [2]}, n=4)
    assert len(batch.samples) == 12 and not batch.failures
    assert batch.weight_version == "engine-test"
    for s in batch.samples:
        assert s.support_ids.shape == (s.num_tokens, 9)
        assert s.support_valid[:, :8].all()  # vocab 18 > K = 8: full top-K everywhere
        # the support's probabilities are a sub-distribution
        assert float(s.support_logprobs.exp().where(s.support_valid, 0).sum(-1).max()) \
            <= 1 + 1e-5
    again = vllm_server.engine().generate([[1, 5, 6, 14, 3, 4, 15]] * 3,
                                          {"temperature": 1.0, "max_new_tokens": 4,
                                           "stop_token_ids": [2]}, n=4)
    # per-request seeds: the same (seed, call) draws the same tokens
    for a, b in zip(batch.samples, again.samples):
        assert torch.equal(a.response_ids, b.response_ids)
