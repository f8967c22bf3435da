"""SGLangEngine against the fake SGLang HTTP server (real sockets on 127.0.0.1).

The fake answers like sglang 0.5.22/0.5.23 (tests/support/fake_sglang.py: formats, validation,
routes and session rules checked against the installed packages by the sglang_api tests). Checks:
response parsing end to end, the bookkeeping invariant under injected faults (every (prompt,
sample) exactly once as a sample or a failure, errors naming the right sample), sampling-param
refusals, startup checks, weight-sync order, sessions and versioning through /model_info, the
scoring path's row mapping, the API key, and several servers behind one engine.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import time

import pytest
import torch
from tiny_lm import VOCAB, TinyLM, prompts
from fake_sglang import Fault, FakeSGLangServer, parse_rid

from rollout_bridge import (
    EngineMismatchError,
    LocalEngine,
    RolloutFailedError,
    SamplingParamsError,
    SGLangEngine,
    StaleRolloutError,
    WeightSyncError,
    check_weight_version,
)
from rollout_bridge.sglang.parse_flat import scoring_rows
from rollout_bridge.core.types import RolloutValidationError
from rollout_bridge.core.weights import save_hf_safetensors

PARAMS = {"temperature": 1.0, "max_new_tokens": 6}


def _client(server, **kw) -> SGLangEngine:
    args = dict(top_logprobs=5, timeout_s=10.0, max_retries=2, backoff_s=0.001,
                backoff_max_s=0.01, vocab_size=VOCAB)
    args.update(kw)
    return SGLangEngine(server.url, **args)


def _assert_complete(batch, num_prompts, n):
    keys = [(s.prompt_index, s.sample_index) for s in batch.samples] + \
        [(f.prompt_index, f.sample_index) for f in batch.failures]
    assert sorted(keys) == [(p, j) for p in range(num_prompts) for j in range(n)]


def _names(server):
    return [n for n, _ in server.calls if n not in ("generate", "served")]


def test_generate_end_to_end(server):
    client = _client(server)
    info = client.check_server()
    assert info["model_path"] == "tiny-lm" and info["weight_version"] == "0"
    batch = client.generate(prompts(4), PARAMS, n=3)
    _assert_complete(batch, 4, 3)
    assert not batch.failures and batch.weight_version == "0" and batch.top_logprobs == 5
    for s in batch.samples:
        assert s.support_ids.shape == (s.num_tokens, 6)
        assert s.prompt_ids.tolist() == prompts(4)[s.prompt_index]
        assert s.meta_info["weight_version"] == "0" and s.meta_info["attempts"] == 1
        assert s.finish_reason in ("stop", "length")
    body = [b for name, b in server.calls if name == "generate"][0]
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 5
    assert body["return_text_in_logprobs"] is False
    assert len(body["input_ids"]) == 3 and body["input_ids"][0] == body["input_ids"][2]
    assert "get_weight_version" not in _names(server)


FAULTS = {0: Fault("http500"), 1: Fault("drop"), 2: Fault("malformed"),
          3: Fault("delay", delay_s=12.0), 4: Fault(abort_items=(0, 1)), 5: Fault("not_list"),
          6: Fault(corrupt_items=(1,)), 7: Fault(ragged_items=(0, 1))}


@pytest.mark.parametrize("persistent", [False, True])
def test_faults_every_prompt_accounted_for(server, persistent):
    """Transient faults are retried to success; persistent ones end as reported failures whose
    error names the failing sample (also after a retry that re-sent it alone)."""
    def fault_fn(body, call_no):
        p, _, attempt = parse_rid(body["rid"][0])
        return FAULTS.get(p) if (attempt == 1 or persistent) else None

    server.fault_fn = fault_fn
    client = _client(server, max_retries=1, timeout_s=6.0)
    start = time.perf_counter()
    batch = client.generate(prompts(9), PARAMS, n=2)
    elapsed = time.perf_counter() - start
    _assert_complete(batch, 9, 2)
    if not persistent:
        assert not batch.failures
        attempts = {(s.prompt_index, s.sample_index): s.meta_info["attempts"] for s in batch}
        for p in range(9):
            if p == 6:
                assert attempts[(6, 0)] == 1 and attempts[(6, 1)] == 2
                continue
            assert attempts[(p, 0)] == (1 if p in (7, 8) else 2), p
        ragged = [s for s in batch if s.prompt_index == 7]
        assert all(s.meta_info["num_short_positions"] > 0 for s in ragged)
        assert all((~s.support_valid[:, :5]).any() for s in ragged)
    else:
        kinds = {(f.prompt_index, f.sample_index): f.kind for f in batch.failures}
        expected = {0: "http", 1: "connection", 2: "malformed", 3: "timeout", 4: "abort",
                    5: "malformed"}
        for p, kind in expected.items():
            assert kinds[(p, 0)] == kinds[(p, 1)] == kind, (p, kinds)
        assert kinds[(6, 1)] == "invalid" and (6, 0) not in kinds
        assert all(f.attempts == 2 for f in batch.failures if f.prompt_index != 6)
        with pytest.raises(RolloutFailedError):
            server.fault_fn = lambda body, n: Fault("http500")
            client.generate(prompts(1), PARAMS, n=1, raise_on_failure=True)
    assert elapsed < 60


def test_permanent_failure_after_retry_names_the_sample(server):
    """Sample 1 fails twice; its retry request holds it alone at position 0, and the failure
    must still say sample 1 (it used to say sample 0, the position inside the retry)."""
    server.fault_fn = lambda body, n: Fault(corrupt_items=(1,))
    batch = _client(server, max_retries=1).generate(prompts(1), PARAMS, n=2)
    (failure,) = batch.failures
    assert (failure.prompt_index, failure.sample_index, failure.attempts) == (0, 1, 2)
    assert "sample 1" in failure.error and "sample 0" not in failure.error, failure.error


def test_4xx_not_retried(server):
    client = _client(server)
    server.fault_fn = lambda body, n: Fault("http400")
    bad = client.generate(prompts(2), PARAMS)
    assert [(f.attempts, f.kind) for f in bad.failures] == [(1, "http"), (1, "http")]
    server.fault_fn = None
    bad = client.generate([[VOCAB + 100]], PARAMS)     # server 500s on out-of-range ids
    assert len(bad.failures) == 1 and bad.failures[0].attempts == 3


@pytest.mark.parametrize("params", [
    {"top_p": 0.9}, {"top_k": 0}, {"top_k": 5}, {"min_p": 0.1}, {"frequency_penalty": 0.5},
    {"presence_penalty": -0.2}, {"repetition_penalty": 1.1}, {"logit_bias": {"7": 2.0}},
    {"regex": "[0-9]+"}, {"json_schema": "{}"}, {"ebnf": "root ::= \"a\""},
    {"min_new_tokens": 2}, {"stop": "</s>"}, {"custom_params": {"x": 1}}, {"bogus": 1},
    {"temperature": -1.0}])
def test_sampling_params_refused_before_any_request(server, params):
    """Settings under which the returned logprobs are not the policy's tempered softmax, or that
    SGLang itself answers 400 (top_k=0, string stops with --skip-tokenizer-init, unknown keys),
    are refused without sending anything."""
    with pytest.raises(SamplingParamsError):
        _client(server).generate(prompts(1), dict(PARAMS, **params))
    assert server.num_generate == 0


def test_neutral_sampling_params_pass(server):
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
               "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
               "logit_bias": {}, "stop_token_ids": [3], "sampling_seed": 5}
    batch = _client(server).generate(prompts(1), dict(PARAMS, **neutral))
    assert not batch.failures


def test_startup_checks(server, tmp_path):
    assert _client(server).check_server()["weight_version"] == "0"
    with pytest.raises(EngineMismatchError):
        _client(server, expected_model_path="other").check_server()
    with pytest.raises(EngineMismatchError):
        SGLangEngine("http://127.0.0.1:9", control_timeout_s=1).check_server()
    # SGLang reports no vocabulary: it is checked against the served config.json when readable
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB + 1}))
    server.model_path = str(tmp_path)
    assert _client(server, vocab_size=None).check_server()["model_path"] == str(tmp_path)
    with pytest.raises(EngineMismatchError, match="vocab_size"):
        _client(server).check_server()


def test_no_get_weight_version_route(server):
    """sglang 0.5.21+ has no /get_weight_version (404); the version comes from /model_info."""
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.url + "/get_weight_version", timeout=5)
    assert err.value.code == 404
    assert _client(server).weight_version() == "0"
    assert "model_info" in _names(server)


def test_weight_sync_order_version_and_stale(server, tmp_path):
    client = _client(server)
    old = client.generate(prompts(2), PARAMS, n=2)
    trainer = TinyLM(seed=9)
    path = save_hf_safetensors(trainer.state_dict(), str(tmp_path / "w1"), dtype=None)
    server.calls.clear()
    assert client.update_weights_from_disk(path, "1") == "1"
    assert _names(server) == ["pause_generation", "update_weights_from_disk",
                              "continue_generation", "model_info"]
    body = server.calls[1][1]
    assert body["model_path"] == path and body["weight_version"] == "1" and body["flush_cache"]
    assert torch.equal(server.engine.model.out.weight, trainer.out.weight)
    new = client.generate(prompts(2), PARAMS, n=2)
    assert new.weight_version == "1"
    assert all(s.meta_info["weight_version"] == "1" for s in new)
    check_weight_version(new, "1")
    with pytest.raises(StaleRolloutError):
        check_weight_version(old, "1")
    check_weight_version(old, {"0", "1"})
    # A failing update still resumes generation, then raises WeightSyncError (never a private
    # exception type).
    server.calls.clear()
    with pytest.raises(WeightSyncError):
        client.update_weights_from_disk(str(tmp_path / "missing"), "2")
    assert _names(server) == ["pause_generation", "update_weights_from_disk",
                              "continue_generation"]
    assert not server.paused and client.weight_version() == "1"


def test_unreachable_server_sync_raises_weight_sync_error():
    client = SGLangEngine("http://127.0.0.1:9", control_timeout_s=1)
    with pytest.raises(WeightSyncError):
        client.update_weights_from_disk("/nowhere", "1")


def test_tensor_update_runs_inside_a_session(server):
    """update_weights_from_tensor / _distributed must run between begin_weight_update and
    end_weight_update (SGLang's scheduler refuses them otherwise)."""
    client = _client(server)

    def serialize(named):   # stand-in transport: base64 torch.save per (single) TP rank
        buf = io.BytesIO()
        torch.save(dict(named), buf)
        return [base64.b64encode(buf.getvalue()).decode()]

    server.tensor_deserializer = lambda blobs: torch.load(io.BytesIO(base64.b64decode(blobs[0])))
    trainer = TinyLM(seed=4)
    server.calls.clear()
    assert client.update_weights_from_tensor(list(trainer.state_dict().items()), "t1",
                                             serialize_fn=serialize) == "t1"
    assert torch.equal(server.engine.model.emb.weight, trainer.emb.weight)
    assert _names(server) == ["pause_generation", "begin_weight_update",
                              "update_weights_from_tensor", "end_weight_update",
                              "continue_generation", "model_info"]
    assert client.weight_version() == "t1"
    # the session is closed again; a bare update is refused like SGLang refuses it
    with pytest.raises(Exception, match="between begin_weight_update"):
        client.http.checked_all("update_weights_from_tensor",
                            {"serialized_named_tensors": serialize([])})
    # an update that fails inside the session still ends it and resumes generation
    server.tensor_deserializer = lambda blobs: {"no_such_weight": torch.zeros(1)}
    server.calls.clear()
    with pytest.raises(WeightSyncError):
        client.update_weights_from_tensor([], "t2", serialize_fn=serialize)
    assert _names(server)[-2:] == ["end_weight_update", "continue_generation"]
    assert not server.session.open and not server.paused and client.weight_version() == "t1"


def test_scoring_rows_mapping():
    # SGLang: a null row at logprob_start_len; the client starts one before the response
    assert scoring_rows(4, 3, 3, 1).tolist() == [0, 1, 2]
    # start earlier (covers 2 prompt tokens too)
    assert scoring_rows(4, 3, 1, 1).tolist() == [2, 3, 4]
    # start at the prompt length: the first response token has no row -> a validation error
    with pytest.raises(RolloutValidationError, match="first response token"):
        scoring_rows(4, 3, 4, 1)


@pytest.mark.parametrize("ragged", [False, True])
def test_output_flat_b64_matches_json_path(server, ragged):
    """topk_transport="flat_b64": one request; the output top-K comes as base64 arrays (or, for
    ragged rows, nested, as SGLang falls back) and parses to exactly the JSON path's tensors."""
    server.deterministic_seeds = True  # same (prompt, sample) -> same tokens for both clients
    if ragged:
        server.fault_fn = lambda body, n: Fault(ragged_items={0, 1})
    kw = dict(top_logprobs=4)
    json_batch = _client(server, **kw).generate(prompts(3), PARAMS, n=2)
    flat_batch = _client(server, topk_transport="flat_b64", **kw).generate(prompts(3), PARAMS,
                                                                          n=2)
    assert not json_batch.failures and not flat_batch.failures
    gens = [b for n, b in server.calls if n == "generate"]
    flat_bodies = [b for b in gens if b.get("return_flat_raw_output_top_logprobs")]
    assert flat_bodies and all(b["return_flat_raw_top_logprobs_b64"] for b in flat_bodies)
    assert len(gens) == 2 * len(flat_bodies)  # no scoring requests
    for a, b in zip(json_batch, flat_batch):
        assert torch.equal(a.response_ids, b.response_ids)
        for name in ("support_ids", "support_logprobs", "support_valid", "behavior_logprob"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    server.fault_fn, server.deterministic_seeds = None, False


@pytest.mark.parametrize("transport", ["json", "flat_b64"])
def test_pos_inf_topk_is_an_error_in_every_transport(server, transport):
    """A +inf top-K logprob is corrupt: the JSON path raised, flat_b64 used to turn it into an
    invalid slot silently."""
    server.fault_fn = lambda body, n: Fault(inf_items=(0,))
    batch = _client(server, topk_transport=transport, max_retries=0).generate(
        prompts(1), PARAMS, n=2)
    assert [(f.sample_index, f.kind) for f in batch.failures] == [(0, "invalid")]
    assert "inf" in batch.failures[0].error


def test_scoring_b64_path_matches_the_full_distribution(server):
    """scoring_b64 at T=1: every response token, the first included, gets the top-K of the
    prefill (SGLang's prompt rows start with a null row at logprob_start_len)."""
    b64_client = _client(server, top_logprobs=4, topk_transport="scoring_b64")
    batch = b64_client.generate(prompts(3), PARAMS, n=2)
    assert not batch.failures
    eng = server.engine
    for s in batch:
        assert s.meta_info["topk_transport"] == "scoring_b64"
        full = torch.cat([s.prompt_ids, s.response_ids]).tolist()
        lp_lv = eng.score(full, 1.0)
        p = s.prompt_ids.shape[0]
        vals, ids = torch.topk(lp_lv[p - 1:p - 1 + s.num_tokens], 4)
        assert torch.equal(s.support_ids[:, :4].long(), ids)
        torch.testing.assert_close(s.support_logprobs[:, :4], vals, atol=1e-5, rtol=1e-6)
    scoring = [b for n, b in server.calls if n == "generate" and
               b.get("return_flat_raw_top_logprobs_b64")]
    assert scoring and all(b["return_flat_raw_top_logprobs"] for b in scoring)
    assert scoring[0]["sampling_params"]["max_new_tokens"] == 0
    for body in scoring:   # logprob_start_len = prompt length - 1 of that request's prompt
        start = body["logprob_start_len"]
        assert all(ids[:start + 1] in prompts(3) for ids in body["input_ids"])


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_scoring_b64_refuses_tempered_sampling(server, temperature):
    """SGLang's prompt-side top-K is untempered while the sampled logprob is tempered."""
    client = _client(server, topk_transport="scoring_b64")
    with pytest.raises(SamplingParamsError, match="untempered"):
        client.generate(prompts(1), dict(PARAMS, temperature=temperature))
    assert not client.generate(prompts(1), dict(PARAMS, temperature=0.0)).failures


def test_api_key_sent_on_every_request_and_never_logged(tiny_model, caplog):
    key = "pdm-test-key-0123456789abcdef"
    srv = FakeSGLangServer(LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=5, seed=1,
                                       eos_token_id=3), api_key=key)
    srv.start()
    try:
        caplog.set_level(logging.DEBUG)
        with pytest.raises(EngineMismatchError, match="401"):
            _client(srv).check_server()
        denied = _client(srv, max_retries=0).generate(prompts(1), PARAMS)
        assert denied.failures and "401" in denied.failures[0].error
        with pytest.raises(WeightSyncError, match="401"):
            _client(srv).update_weights_from_disk("/x", "1")
        client = _client(srv, api_key=key)
        assert key not in repr(client.__dict__)
        client.check_server()
        assert not client.generate(prompts(2), PARAMS, n=2).failures
        srv.unauthorized.clear()
        trainer = TinyLM(seed=3)
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            path = save_hf_safetensors(trainer.state_dict(), d, dtype=None)
            client.update_weights_from_disk(path, "1")
        assert srv.unauthorized == []
        assert key not in caplog.text
    finally:
        srv.stop()


def test_two_servers_spread_rollouts_and_sync_both(tmp_path):
    servers = [FakeSGLangServer(LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=5, seed=s,
                                            eos_token_id=3)) for s in (1, 2)]
    for s in servers:
        s.start()
    try:
        client = SGLangEngine([s.url for s in servers], top_logprobs=5, vocab_size=VOCAB,
                              timeout_s=10, backoff_s=0.001)
        assert client.check_server()["num_servers"] == 2
        batch = client.generate(prompts(6), PARAMS, n=2)
        assert not batch.failures
        per_server = [sum(len(b["input_ids"]) for n, b in s.calls if n == "generate")
                      for s in servers]
        assert per_server == [6, 6], per_server
        assert {s.meta_info["server"] for s in batch} == {s.url for s in servers}
        trainer = TinyLM(seed=5)
        path = save_hf_safetensors(trainer.state_dict(), str(tmp_path / "w"), dtype=None)
        assert client.update_weights_from_disk(path, "7") == "7"
        for s in servers:
            assert s.engine.weight_version() == "7"
            assert torch.equal(s.engine.model.out.weight, trainer.out.weight)
        assert client.generate(prompts(2), PARAMS).weight_version == "7"
        # a server whose version disagrees is refused at start and after a sync
        servers[1].engine._version = "6"
        with pytest.raises(EngineMismatchError, match="different weight versions"):
            client.check_server()
        # one server down: its prompts are retried on the other
        servers[1].stop()
        batch = client.generate(prompts(4), PARAMS, n=1)
        assert not batch.failures
        assert {s.meta_info["server"] for s in batch} == {servers[0].url}
    finally:
        servers[0].stop()
