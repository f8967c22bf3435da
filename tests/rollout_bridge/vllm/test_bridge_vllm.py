"""VLLMEngine against the fake vLLM HTTP server (real sockets on 127.0.0.1) and the parser.

Checks: the completion-choice parser (sampled token first, K vs K+1 keys, -9999 clamp, errors
naming sample and position); generate end to end with per-request seeds (a retried sample is
drawn again identically); the exactly-once bookkeeping under injected faults; the weight push
(pause -> rpc -> digest -> version -> resume) and its failure; the start-up checks (API key,
logprobs mode, vocabulary, dev mode, open dev routes on a non-loopback address); restarts: the
cached weights are re-pushed and the batch equals the undisturbed one, or the samples fail
with a "restart" error; a version changed behind the client's back is refused.
"""

from __future__ import annotations

import pytest
import torch
from tiny_lm import VOCAB, TinyLM, prompts
from fake_vllm import FakeVLLMServer, VFault, engine_weights

from rollout_bridge import (
    EngineMismatchError,
    LocalEngine,
    RolloutFailedError,
    RolloutValidationError,
    WeightSyncError,
)
from rollout_bridge.vllm import control as vllm_control
from rollout_bridge.vllm.parse import parse_completion_choice
from rollout_bridge.vllm.client import VLLMEngine

PARAMS = {"temperature": 1.0, "max_new_tokens": 6}
KEY = "k3y"


def _engine(seed=1):
    return LocalEngine(TinyLM(seed=seed), vocab_size=VOCAB, top_logprobs=5, seed=seed,
                       eos_token_id=3)


@pytest.fixture
def vserver():
    srv = FakeVLLMServer(_engine(), api_key=KEY)
    srv.start()
    yield srv
    srv.stop()


def _client(srv, **kw) -> VLLMEngine:
    args = dict(top_logprobs=5, api_key=KEY, timeout_s=5.0, max_retries=2, backoff_s=0.001,
                backoff_max_s=0.01, vocab_size=VOCAB, seed=3)
    args.update(kw)
    return VLLMEngine(srv.url, **args)


def _complete(batch, num_prompts, n):
    keys = [(s.prompt_index, s.sample_index) for s in batch.samples] + \
        [(f.prompt_index, f.sample_index) for f in batch.failures]
    assert sorted(keys) == [(p, j) for p in range(num_prompts) for j in range(n)]


def _same(a, b):
    assert [(s.prompt_index, s.sample_index) for s in a.samples] == \
        [(s.prompt_index, s.sample_index) for s in b.samples]
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.response_ids, y.response_ids)
        assert torch.equal(x.support_ids, y.support_ids)
        assert torch.allclose(x.support_logprobs, y.support_logprobs)


# ---------------------------------------------------------------------------------------- parser

def _choice(ids, lps, tops, reason="length"):
    return {"index": 0, "finish_reason": reason, "token_ids": ids,
            "logprobs": {"token_logprobs": lps,
                         "top_logprobs": [{f"token_id:{i}": v for i, v in t} for t in tops]}}


def test_parser_k_and_k_plus_one_keys():
    # pos 0: sampled 7 outside the top-2 (3 keys); pos 1: sampled 4 inside (2 keys, first)
    c = _choice([7, 4], [-3.0, -0.5],
                [[(7, -3.0), (1, -0.4), (2, -1.9)], [(4, -0.5), (9, -1.1)]])
    s = parse_completion_choice(c, 2, vocab_size=10)
    assert s.response_ids.tolist() == [7, 4]
    assert s.support_ids.tolist() == [[1, 2, 7], [4, 9, 0]]
    assert s.support_valid.tolist() == [[True, True, True], [True, True, False]]
    assert s.support_logprobs[0].tolist() == pytest.approx([-0.4, -1.9, -3.0])
    assert s.meta_info["sampled_in_topk"] == 1


def test_parser_clamp_short_and_errors():
    # -9999 = vLLM's -inf: an invalid top-K slot; a short list leaves slots invalid
    c = _choice([1, 2], [-0.1, -0.2], [[(1, -0.1), (5, -9999.0)], [(2, -0.2)]])
    s = parse_completion_choice(c, 2, vocab_size=10)
    assert s.support_valid.tolist() == [[True, False, False], [True, False, False]]
    assert s.meta_info["num_neg_inf_slots"] == 1
    with pytest.raises(RolloutValidationError, match="sample 3, position 1.*start with the "
                                                     "sampled token"):
        parse_completion_choice(_choice([1, 2], [-0.1, -0.2], [[(1, -0.1)], [(5, -0.2)]]), 2,
                                10, sample_index=3)
    with pytest.raises(RolloutValidationError, match="position 0.*not finite"):
        parse_completion_choice(_choice([1], [-9999.0], [[(1, -9999.0)]]), 1, 10)
    with pytest.raises(RolloutValidationError, match="length mismatch"):
        parse_completion_choice(_choice([1, 2], [-0.1], [[(1, -0.1)]]), 1, 10)
    with pytest.raises(RolloutValidationError, match="out of range"):
        parse_completion_choice(_choice([12], [-0.1], [[(12, -0.1)]]), 1, 10)
    bad = _choice([1], [-0.1], [[(1, -0.1)]])
    bad["logprobs"]["top_logprobs"] = [{"1": -0.1}]
    with pytest.raises(RolloutValidationError, match="return_tokens_as_token_ids"):
        parse_completion_choice(bad, 1, 10)
    with pytest.raises(RolloutValidationError, match="return_token_ids"):
        parse_completion_choice({"index": 0, "finish_reason": "stop", "token_ids": None}, 1, 10)


# ---------------------------------------------------------------------------------------- generate

def test_generate_end_to_end_and_seeds(vserver):
    client = _client(vserver)
    info = client.check_server()
    assert info["model"] == "pdm-policy" and info["weight_version"] == "default"
    assert info["dev_routes_guarded"] is True
    batch = client.generate(prompts(4), PARAMS, n=3)
    _complete(batch, 4, 3)
    assert not batch.failures and batch.weight_version == "default"
    for s in batch.samples:
        assert s.support_ids.shape == (s.num_tokens, 6)
        assert s.prompt_ids.tolist() == prompts(4)[s.prompt_index]
        assert s.meta_info["attempts"] == 1
    body = next(b for name, b in vserver.calls if name == "completions")
    assert body["n"] == 3 and body["logprobs"] == 5 and body["max_tokens"] == 6
    assert (body["top_p"], body["top_k"], body["min_p"]) == (1.0, -1, 0.0)
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    # the same call seed draws the same samples; another call draws others
    again = _client(vserver).generate(prompts(4), PARAMS, n=3)
    _same(batch, again)
    other = client.generate(prompts(4), PARAMS, n=3)
    assert any(not torch.equal(a.response_ids, b.response_ids)
               for a, b in zip(batch.samples, other.samples))


def test_faults_every_sample_exactly_once_and_retries_redraw_identically(vserver):
    clean = _client(vserver).generate(prompts(5), PARAMS, n=4)

    def fault(body, call_no):
        p = prompts(5).index(body["prompt"])
        if body["n"] == 4:  # first attempts
            return {0: VFault("http500"), 1: VFault("drop"), 2: VFault("malformed"),
                    3: VFault(abort_children=(1, 3))}.get(p)
        return None

    vserver.fault_fn = fault
    batch = _client(vserver).generate(prompts(5), PARAMS, n=4)
    _complete(batch, 5, 4)
    assert not batch.failures
    _same(clean, batch)  # retried samples use their own seeds: identical draws
    attempts = {(s.prompt_index, s.sample_index): s.meta_info["attempts"] for s in batch.samples}
    assert attempts[(0, 2)] == 2 and attempts[(3, 1)] == 2 and attempts[(3, 0)] == 1
    assert attempts[(4, 0)] == 1


def test_non_retryable_and_exhausted_failures(vserver):
    vserver.fault_fn = lambda body, i: (VFault("http400") if body["prompt"] == prompts(3)[1]
                                        else VFault("http500") if body["prompt"] == prompts(3)[2]
                                        else None)
    client = _client(vserver, max_retries=1)
    batch = client.generate(prompts(3), PARAMS, n=2)
    _complete(batch, 3, 2)
    kinds = {(f.prompt_index, f.sample_index): (f.kind, f.attempts) for f in batch.failures}
    assert kinds == {(1, 0): ("http", 1), (1, 1): ("http", 1), (2, 0): ("http5xx", 2),
                     (2, 1): ("http5xx", 2)}
    with pytest.raises(RolloutFailedError, match="prompt 1/0"):
        client.generate(prompts(3), PARAMS, n=2, raise_on_failure=True)


def test_sampling_param_mapping():
    c = VLLMEngine("http://127.0.0.1:1", top_logprobs=2)
    assert c.request_params({"max_new_tokens": 4, "stop_token_ids": [2], "temperature": 0.5}) \
        == {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 4, "stop_token_ids": [2],
            "temperature": 0.5}
    with pytest.raises(ValueError, match="not supported"):
        c.request_params({"stop": ["x"]})


# ---------------------------------------------------------------------------------------- weights

def test_weight_push_sequence_digest_and_version(vserver):
    client = _client(vserver)
    client.check_server()
    new = engine_weights(_engine(seed=9))
    assert client.update_weights(new, "5") == "5"
    names = [n for n, _ in vserver.calls if n != "completions"]
    assert names == ["collective_rpc", "pause", "collective_rpc", "update_weight_version",
                     "resume"]
    pause = next(b for n, b in vserver.calls if n == "pause")
    assert pause["mode"] == "wait" and pause["clear_cache"] == "true"
    assert client.weight_version() == "5"
    for k, v in new.items():
        assert torch.equal(vserver.engine.model.state_dict()[k], v)
    batch = client.generate(prompts(2), PARAMS, n=2)
    assert batch.weight_version == "5"
    # a worker that loaded something else: refused, generation resumed
    vserver.digest_override = "0" * 64
    with pytest.raises(WeightSyncError, match="digest"):
        client.update_weights(new, "6")
    assert vserver.paused is False and client.weight_version() == "5"


def test_weight_push_through_a_file(vserver, tmp_path):
    """push_dir: the blob goes as a file the server reads; digest and version checked the same;
    the last file is kept (re-push after a restart), the one before it deleted."""
    client = _client(vserver, push_dir=str(tmp_path))
    client.check_server()
    new = engine_weights(_engine(seed=9))
    assert client.update_weights(new, "5") == "5"
    assert vserver.loads == ["pdm_load_weights_file"]
    assert client.last_push_info["transport"] == "file"
    first = sorted(tmp_path.iterdir())
    assert len(first) == 1 and first[0].name.endswith("-5.safetensors")
    for k, v in new.items():
        assert torch.equal(vserver.engine.model.state_dict()[k], v)
    assert client.update_weights(engine_weights(_engine(seed=10)), "6") == "6"
    assert [p.name for p in tmp_path.iterdir()] == [first[0].name.replace("-5.", "-6.")]
    assert client.generate(prompts(2), PARAMS, n=2).weight_version == "6"
    vserver.digest_override = "0" * 64
    with pytest.raises(WeightSyncError, match="digest"):
        client.update_weights(new, "7")


# ---------------------------------------------------------------------------------------- checks

def test_start_up_checks(vserver):
    with pytest.raises(EngineMismatchError, match="API key was rejected"):
        _client(vserver, api_key="wrong").check_server()
    with pytest.raises(EngineMismatchError, match="vocab_size"):
        _client(vserver, vocab_size=VOCAB + 1).check_server()
    with pytest.raises(EngineMismatchError, match="max-logprobs"):
        _client(vserver, top_logprobs=21).check_server()
    vserver.logprobs_mode = "raw_logprobs"
    with pytest.raises(EngineMismatchError, match="processed_logprobs"):
        _client(vserver).check_server()


def test_dev_mode_off_and_open_dev_routes(monkeypatch):
    loopback = vllm_control.is_loopback_url
    assert loopback("http://127.0.0.1:8000") and loopback("http://localhost:8000")
    assert not loopback("http://10.0.0.5:8000")
    srv = FakeVLLMServer(_engine(), api_key=KEY, dev_mode=False)
    srv.start()
    try:
        with pytest.raises(EngineMismatchError, match="VLLM_SERVER_DEV_MODE"):
            _client(srv).check_server()
    finally:
        srv.stop()
    srv = FakeVLLMServer(_engine(), api_key=KEY, guard_dev_routes=False)
    srv.start()
    try:
        # loopback: accepted with a warning
        assert _client(srv).check_server()["dev_routes_guarded"] is False
        # anywhere else: refused unless the user opts in
        monkeypatch.setattr(vllm_control, "is_loopback_url", lambda url: False)
        with pytest.raises(EngineMismatchError, match="allow_insecure_dev_routes"):
            _client(srv).check_server()
        assert _client(srv, allow_insecure_dev_routes=True).check_server()
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------- restarts

def test_restart_mid_call_repushes_and_redraws(vserver):
    client = _client(vserver)
    client.update_weights(engine_weights(_engine(seed=9)), "3")
    clean = client.generate(prompts(4), PARAMS, n=2)
    crashed = []

    def fault(body, call_no):
        if body["prompt"] == prompts(4)[2] and not crashed:
            crashed.append(call_no)
            return VFault("restart")
        return None

    # the same call seed as `clean` (so the draws are comparable)
    client2 = _client(vserver, recover_timeout_s=10.0)
    client2.update_weights(engine_weights(_engine(seed=9)), "3")
    vserver.fault_fn = fault
    batch = client2.generate(prompts(4), PARAMS, n=2)
    assert crashed and client2.num_repushes == 1
    _complete(batch, 4, 2)
    assert not batch.failures and batch.weight_version == "3"
    _same(clean, batch)
    assert client2.weight_version() == "3"


def test_restart_at_the_version_check_after_the_rollouts_redraws_them(vserver):
    """The server dies after the call's last sample, before the version check: the samples
    cannot be attributed, so the guard recovers the server (re-push) and the call draws them
    again with their own seeds: the same samples as a call without the crash."""
    client = _client(vserver)
    client.update_weights(engine_weights(_engine(seed=9)), "3")
    clean = client.generate(prompts(3), PARAMS, n=2)
    client2 = _client(vserver, recover_timeout_s=10.0)
    client2.update_weights(engine_weights(_engine(seed=9)), "3")
    before = vserver.num_completions
    vserver.crash_at_weight_info = [before + 3]  # after the call's 3 requests (one per prompt)
    batch = client2.generate(prompts(3), PARAMS, n=2)
    assert vserver.crash_at_weight_info == [] and client2.num_repushes == 1
    assert vserver.num_completions - before == 6  # every prompt drawn again
    _complete(batch, 3, 2)
    assert not batch.failures and batch.weight_version == "3"
    _same(clean, batch)


def test_restart_at_every_version_check_gives_up_clearly(vserver):
    client = _client(vserver, recover_timeout_s=10.0, max_recoveries=1)
    client.update_weights(engine_weights(_engine(seed=9)), "3")
    n0 = vserver.num_completions
    vserver.crash_at_weight_info = [n0 + 2, n0 + 4]  # after the call, after its redraw
    with pytest.raises(EngineMismatchError, match="version check after the rollouts failed"):
        client.generate(prompts(2), PARAMS, n=2)


def test_restart_without_cached_weights_fails_clearly(vserver):
    vserver.down_s = 0.0  # back at once: the version check, not the connection, must catch it
    client = _client(vserver, repush_on_restart=False)
    client.update_weights(engine_weights(_engine(seed=9)), "3")
    vserver.fault_fn = lambda body, i: VFault("restart") if i == 2 else None
    batch = client.generate(prompts(3), PARAMS, n=2)
    _complete(batch, 3, 2)
    assert batch.failures and all(f.kind == "restart" for f in batch.failures)
    assert "expected '3'" in batch.failures[0].error
    assert all(s.weight_version == "3" for s in batch.samples)


def test_restart_between_calls_is_caught_before_sending(vserver):
    client = _client(vserver, recover_timeout_s=10.0)
    client.check_server()
    client.update_weights(engine_weights(_engine(seed=9)), "3")
    vserver.restart()
    batch = client.generate(prompts(2), PARAMS, n=2)  # re-pushed before the first request
    assert client.num_repushes == 1 and batch.weight_version == "3" and not batch.failures


def test_version_changed_behind_the_clients_back_is_refused(vserver):
    client = _client(vserver)
    client.update_weights(engine_weights(_engine(seed=9)), "3")
    vserver.fault_fn = lambda body, i: VFault("bump_version") if i == 1 else None
    with pytest.raises(EngineMismatchError, match="changed from '3'"):
        client.generate(prompts(2), PARAMS, n=2)


def test_server_down_fails_with_connection_errors():
    client = VLLMEngine("http://127.0.0.1:9", top_logprobs=2, max_retries=1, backoff_s=0.001,
                        timeout_s=2)
    client.model = "m"
    batch = client.generate(prompts(2), PARAMS, n=2)
    _complete(batch, 2, 2)
    assert {f.kind for f in batch.failures} == {"connection"}
    assert "unreachable" in batch.failures[0].error


def test_push_into_a_dying_server_is_repeated_once_it_is_back(vserver):
    client = _client(vserver, recover_timeout_s=10.0)
    client.check_server()
    vserver.crash_on_next_load = True
    new = engine_weights(_engine(seed=9))
    assert client.update_weights(new, "4") == "4"
    assert client.weight_version() == "4"
    for k, v in new.items():
        assert torch.equal(vserver.engine.model.state_dict()[k], v)
    # without waiting, the same crash is a WeightSyncError naming the failed request
    vserver.crash_on_next_load = True
    with pytest.raises(WeightSyncError, match="weight push of version 5 failed"):
        _client(vserver).update_weights(new, "5")
