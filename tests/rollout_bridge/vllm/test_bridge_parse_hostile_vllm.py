"""Hostile engine bodies, vLLM completion choices: a validated result or one of the two validation
errors, naming sample, position and field (a key id 2**32 + 1 used to wrap to 1; a sampled
logprob that disagrees with its own top-K entry was accepted); then the client reports a
`RolloutFailure`. Shared bodies: hostile_bodies.py.
"""

from __future__ import annotations

import pytest
from tiny_lm import VOCAB, TinyLM, prompts
from hostile_bodies import _all, _check, _set, parse_vllm, vllm_choice

from rollout_bridge import LocalEngine, RolloutValidationError

LP = ("logprobs", "top_logprobs")


def _key(pos: int, old: str, new: str):
    """Renames a vLLM top_logprobs key, keeping the entry order."""
    def mutate(c):
        row = c["logprobs"]["top_logprobs"][pos]
        c["logprobs"]["top_logprobs"][pos] = {new if k == old else k: v for k, v in row.items()}
    return mutate


VLLM_CASES = [
    ("key id 2**32+1 wraps to 1", _key(0, "token_id:1", f"token_id:{2**32 + 1}"), 0,
     ["support_ids slot 0", str(2**32 + 1), "does not fit int32"]),
    ("key id with a space", _key(0, "token_id:1", "token_id: 1"), 0,
     ["entry 1", "'token_id: 1' is not 'token_id:<id>'"]),
    ("key id with a plus", _key(0, "token_id:1", "token_id:+1"), 0, ["'token_id:+1'"]),
    ("key id in Arabic-Indic digits", _key(0, "token_id:1", "token_id:\u0661"), 0,
     ["is not 'token_id:<id>'"]),
    ("key id beyond int64", _key(1, "token_id:9", "token_id:" + "9" * 30), 1,
     ["entry 1", "does not fit int64"]),
    ("token_ids float", _set(("token_ids", 1), 4.0), 1, ["token_ids", "4.0", "a float"]),
    ("token_ids string", _set(("token_ids", 1), "4"), 1, ["token_ids", "'4'", "a string"]),
    ("token_ids bool", _all(_set(("token_ids", 1), True), _key(1, "token_id:4", "token_id:1")),
     1, ["token_ids", "id True is a bool"]),
    ("token_logprobs string", _set(("logprobs", "token_logprobs", 1), "-0.5"), 1,
     ["logprobs.token_logprobs", "'-0.5'", "a string"]),
    ("top-K value string", lambda c: c["logprobs"]["top_logprobs"][0].__setitem__(
        "token_id:1", "-0.4"), 0, ["top_logprobs slot 1", "'-0.4'", "a string"]),
    ("sampled logprob disagrees with its top-K entry (inside)",
     _set(("logprobs", "token_logprobs", 1), -0.7), 1,
     ["token_logprobs has -0.7 for the sampled token 4, its top_logprobs entry -0.5"]),
    ("sampled logprob disagrees with its entry (outside)",
     _set(("logprobs", "token_logprobs", 0), -2.5), 0, ["token_logprobs has -2.5"]),
    ("prompt_token_ids an int", _set(("prompt_token_ids",), 5), None,
     ["prompt_token_ids is int", "not a list"]),
]


@pytest.mark.parametrize("name, mutate, position, words", VLLM_CASES,
                         ids=[c[0] for c in VLLM_CASES])
def test_vllm_hostile(name, mutate, position, words):
    bad = vllm_choice()
    mutate(bad)
    with pytest.raises(RolloutValidationError) as info:
        parse_vllm(bad)
    _check(info.value, position, words)


def test_vllm_engine_reports_a_failure_for_a_hostile_choice():
    from fake_vllm import FakeVLLMServer

    from rollout_bridge.vllm.client import VLLMEngine

    srv = FakeVLLMServer(LocalEngine(TinyLM(seed=1), vocab_size=VOCAB, top_logprobs=5, seed=1,
                                     eos_token_id=3), api_key="k")
    answer = srv._answer

    def tampered(body, fault):
        out = answer(body, fault)
        out["choices"][0]["prompt_token_ids"] = 5  # was a TypeError out of generate
        return out
    srv._answer = tampered
    srv.start()
    try:
        client = VLLMEngine(srv.url, top_logprobs=5, api_key="k", timeout_s=5.0, max_retries=1,
                            backoff_s=0.001, backoff_max_s=0.01, vocab_size=VOCAB, seed=3)
        batch = client.generate(prompts(1), {"temperature": 1.0, "max_new_tokens": 4}, n=1)
    finally:
        srv.stop()
    (failure,) = batch.failures
    assert (failure.attempts, failure.kind) == (2, "invalid")
    assert "prompt_token_ids is int" in failure.error
