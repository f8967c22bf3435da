"""SGLangEngine against the fake SGLang HTTP server (real sockets on 127.0.0.1).

Checks: response parsing end to end, the bookkeeping invariant under injected faults (every
(prompt, sample) exactly once as a sample or a failure), weight-sync order and versioning, startup
checks, the flat-b64 scoring path (row mapping and agreement with the JSON path), and, if sglang
is importable, our payloads against its GenerateReqInput.
"""

from __future__ import annotations

import base64
import io
import time

import pytest
import torch
from conftest import VOCAB, TinyLM, prompts
from fake_sglang import Fault, parse_rid

from rollout_bridge import (
    EngineMismatchError,
    RolloutFailedError,
    SamplingParamsError,
    SGLangEngine,
    StaleRolloutError,
    WeightSyncError,
    check_weight_version,
)
from rollout_bridge.parse_flat import scoring_rows
from rollout_bridge.weights import save_hf_safetensors

PARAMS = {"temperature": 1.0, "max_new_tokens": 6}


def _client(server, **kw) -> SGLangEngine:
    args = dict(top_logprobs=5, timeout_s=1.0, max_retries=2, backoff_s=0.001, backoff_max_s=0.01,
                vocab_size=VOCAB)
    args.update(kw)
    return SGLangEngine(server.url, **args)


def _assert_complete(batch, num_prompts, n):
    keys = [(s.prompt_index, s.sample_index) for s in batch.samples] + \
        [(f.prompt_index, f.sample_index) for f in batch.failures]
    assert sorted(keys) == [(p, j) for p in range(num_prompts) for j in range(n)]


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


FAULTS = {0: Fault("http500"), 1: Fault("drop"), 2: Fault("malformed"),
          3: Fault("delay", delay_s=1.5), 4: Fault(abort_items=(0, 1)), 5: Fault("not_list"),
          6: Fault(corrupt_items=(1,)), 7: Fault(ragged_items=(0, 1))}


@pytest.mark.parametrize("persistent", [False, True])
def test_faults_every_prompt_accounted_for(server, persistent):
    """Transient faults are retried to success; persistent ones end as reported failures."""
    def fault_fn(body, call_no):
        p, _, attempt = parse_rid(body["rid"][0])
        return FAULTS.get(p) if (attempt == 1 or persistent) else None

    server.fault_fn = fault_fn
    client = _client(server, max_retries=1)
    start = time.perf_counter()
    batch = client.generate(prompts(9), PARAMS, n=2)
    elapsed = time.perf_counter() - start
    _assert_complete(batch, 9, 2)
    if not persistent:
        assert not batch.failures
        attempts = {(s.prompt_index, s.sample_index): s.meta_info["attempts"] for s in batch}
        for p in range(9):
            expected = 1 if p in (7, 8) else 2
            if p == 4:
                expected = 2
            if p == 6:
                assert attempts[(6, 0)] == 1 and attempts[(6, 1)] == 2
                continue
            assert attempts[(p, 0)] == expected, p
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
    assert elapsed < 20


def test_4xx_not_retried_and_sampling_refused(server):
    client = _client(server)
    with pytest.raises(SamplingParamsError):
        client.generate(prompts(1), {"top_p": 0.9})
    server.fault_fn = lambda body, n: Fault("http400")
    bad = client.generate(prompts(2), PARAMS)
    assert [(f.attempts, f.kind) for f in bad.failures] == [(1, "http"), (1, "http")]
    server.fault_fn = None
    bad = client.generate([[VOCAB + 100]], PARAMS)     # server 500s on out-of-range ids
    assert len(bad.failures) == 1 and bad.failures[0].attempts == 3


def test_startup_checks(server):
    assert _client(server).check_server()["vocab_size"] == VOCAB
    with pytest.raises(EngineMismatchError):
        _client(server, vocab_size=VOCAB + 1).check_server()
    with pytest.raises(EngineMismatchError):
        _client(server, expected_model_path="other").check_server()
    with pytest.raises(EngineMismatchError):
        SGLangEngine("http://127.0.0.1:9", control_timeout_s=1).check_server()


def test_weight_sync_order_version_and_stale(server, tmp_path):
    client = _client(server)
    old = client.generate(prompts(2), PARAMS, n=2)
    trainer = TinyLM(seed=9)
    path = save_hf_safetensors(trainer.state_dict(), str(tmp_path / "w1"), dtype=None)
    server.calls.clear()
    assert client.update_weights_from_disk(path, "1") == "1"
    names = [n for n, _ in server.calls]
    assert names[:3] == ["pause_generation", "update_weights_from_disk", "continue_generation"]
    assert server.calls[1][1]["model_path"] == path and server.calls[1][1]["weight_version"] == "1"
    assert torch.equal(server.engine.model.out.weight, trainer.out.weight)
    new = client.generate(prompts(2), PARAMS, n=2)
    assert new.weight_version == "1"
    assert all(s.meta_info["weight_version"] == "1" for s in new)
    check_weight_version(new, "1")
    with pytest.raises(StaleRolloutError):
        check_weight_version(old, "1")
    check_weight_version(old, {"0", "1"})
    # A failing update still resumes generation, then raises.
    server.calls.clear()
    with pytest.raises(WeightSyncError):
        client.update_weights_from_disk(str(tmp_path / "missing"), "2")
    assert [n for n, _ in server.calls] == ["pause_generation", "update_weights_from_disk",
                                           "continue_generation"]
    assert not server.paused and client.weight_version() == "1"


def test_tensor_and_distributed_update_bodies(server):
    client = _client(server)

    def serialize(named):   # stand-in transport: base64 torch.save per (single) TP rank
        buf = io.BytesIO()
        torch.save(dict(named), buf)
        return [base64.b64encode(buf.getvalue()).decode()]

    server.tensor_deserializer = lambda blobs: torch.load(io.BytesIO(base64.b64decode(blobs[0])))
    trainer = TinyLM(seed=4)
    assert client.update_weights_from_tensor(list(trainer.state_dict().items()), "t1",
                                             serialize_fn=serialize) == "t1"
    assert torch.equal(server.engine.model.emb.weight, trainer.emb.weight)
    broadcasts = []
    client.init_weights_update_group("127.0.0.1", 29555, 1, 2, "g")
    v = client.update_weights_from_distributed(["out.weight"], [torch.float32], [[64, 16]], "g",
                                               "d1", broadcast_fn=lambda: broadcasts.append(1))
    assert v == "d1" and broadcasts == [1]
    body = [b for n, b in server.calls if n == "update_weights_from_distributed"][0]
    assert body["dtypes"] == ["float32"] and body["shapes"] == [[64, 16]]
    names = [n for n, _ in server.calls if "generation" in n or "update_weights" in n]
    assert names[-3:] == ["pause_generation", "update_weights_from_distributed",
                          "continue_generation"]


def test_scoring_rows_mapping():
    # prompt 4, response 3, start at the prompt length: rows 0..2
    assert scoring_rows(4, 3, 4, 0).tolist() == [0, 1, 2]
    # start earlier (covers 2 prompt tokens too)
    assert scoring_rows(4, 3, 2, 0).tolist() == [2, 3, 4]
    # start 0: position 0 has no row (null prefix 1) -> response token 0 (pos 4) is row 3
    assert scoring_rows(4, 3, 0, 1).tolist() == [3, 4, 5]
    with pytest.raises(ValueError):
        scoring_rows(4, 3, 5, 0)


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


def test_scoring_b64_path_matches_json_path(server):
    json_client = _client(server, top_logprobs=4)
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
    assert all(b["return_flat_raw_top_logprobs"] for b in scoring)
    assert scoring and scoring[0]["sampling_params"]["max_new_tokens"] == 0
    for body in scoring:   # logprob_start_len = prompt length of that request's prompt
        start = body["logprob_start_len"]
        assert all(ids[:start] in prompts(3) for ids in body["input_ids"])
        assert all(ids[:start - 1] not in prompts(3) for ids in body["input_ids"])
    # The JSON path on the same server gives the same support layout semantics.
    jb = json_client.generate(prompts(3), PARAMS, n=2)
    for s in jb:
        full = torch.cat([s.prompt_ids, s.response_ids]).tolist()
        p = s.prompt_ids.shape[0]
        _, ids = torch.topk(eng.score(full, 1.0)[p - 1:p - 1 + s.num_tokens], 4)
        assert torch.equal(s.support_ids[:, :4].long(), ids)


def test_payloads_validate_against_sglang():
    io_struct = pytest.importorskip("sglang.srt.managers.io_struct")
    client = SGLangEngine("http://127.0.0.1:1", top_logprobs=5)
    flat = SGLangEngine("http://127.0.0.1:1", top_logprobs=5, topk_transport="flat_b64")
    for payload in (client.build_generate_payload([1, 2, 3], 2, PARAMS, ["a", "b"]),
                    flat.build_generate_payload([1, 2, 3], 2, PARAMS, ["a", "b"]),
                    client.build_scoring_payload([1, 2], [[3, 4], [5]], 1.0, ["a", "b"])):
        req = io_struct.GenerateReqInput(**payload)
        req.normalize_batch_and_arguments()
        assert req.return_logprob and req.top_logprobs_num
