"""Hostile engine bodies, SGLang nested JSON path: every body returns a validated result or one
of the two validation errors (`RolloutValidationError` / `MalformedResponseError`), naming
sample, position and field; then the client's handling (retry, then a `RolloutFailure`) takes
over.

The table holds bodies that used to end in a RecursionError / IndexError / TypeError /
OverflowError / bare ValueError, or were accepted wrong (a top-K id 2**32 + 2 wrapped to 2 in the
int32 support; 2.7 truncated to 2; "4" and "-2.0" coerced; a bool taken as id 1 or logprob 0).
The other transports: test_bridge_parse_hostile_flat.py (flat arrays, scoring),
test_bridge_parse_hostile_vllm.py; the fuzz of all of them: test_bridge_parse_fuzz.py; shared
bodies: hostile_bodies.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_lm import VOCAB, prompts
from hostile_bodies import BIG, K, OTL, TOP, V, _all, _check, _set, dumps, flat_body, \
    parse_scoring, parse_sglang, parse_vllm, scoring_body, sglang_body, vllm_choice

from rollout_bridge import RolloutValidationError, SGLangEngine, parse_generate_response
from rollout_bridge.core.decode import MalformedResponseError, loads

# (id, mutation of sample 1, vocab, expected position, words in the message)
SGLANG_CASES = [
    ("topk id 2**32+2 wraps to 2", _set(TOP + (0, 1, 1), BIG), V, 0,
     ["support_ids slot 1", str(BIG), "does not fit int32"]),
    ("sampled id 2**32+7, no vocab", _all(_set(OTL + (2, 1), 2**32 + 7),
                                          _set(("output_ids", 2), 2**32 + 7)), None, 2,
     ["sampled_ids", str(2**32 + 7), "does not fit int32"]),
    ("topk id float 2.7", _set(TOP + (0, 1, 1), 2.7), V, 0,
     ["output_top_logprobs slot 1", "2.7", "a float, not an integer"]),
    ("topk id float 2.0", _set(TOP + (0, 1, 1), 2.0), V, 0, ["slot 1", "a float"]),
    ("topk id string", _set(TOP + (1, 1, 1), "4"), V, 1, ["slot 1", "'4'", "a string"]),
    ("topk id bool", _set(TOP + (0, 1, 1), True), V, 0,
     ["slot 1", "id True is a bool, not an integer token id"]),
    ("sampled id bool", _all(_set(OTL + (0, 1), True), _set(("output_ids", 0), True)), V, 0,
     ["output_token_logprobs", "id True is a bool"]),
    ("output_ids float", _set(("output_ids", 1), 4.0), V, 1, ["output_ids", "4.0", "float"]),
    ("topk logprob string", _set(TOP + (1, 1, 0), "-2.0"), V, 1,
     ["slot 1", "'-2.0'", "a string, not a number"]),
    ("sampled logprob string", _set(OTL + (2, 0), "-3.0"), V, 2,
     ["output_token_logprobs", "'-3.0'", "a string"]),
    ("logprob bool (was a 'sum > 1')", _all(_set(TOP + (0, 0, 0), False),
                                             _set(OTL + (0, 0), False)), V, 0,
     ["logprob False is a bool, not a number"]),
    ("logprob -10**400", _set(OTL + (1, 0), -10**400), V, 1, ["is not a finite number"]),
    ("topk id 2**63", _set(TOP + (2, 0, 1), 2**63), V, 2, ["slot 0", "does not fit int64"]),
    ("output_token_logprobs a string", _set(OTL, "abc"), V, None,
     ["output_token_logprobs is a string, not a list"]),
    ("output_token_logprobs of ints", _set(OTL, [1, 4, 7]), V, 0,
     ["output_token_logprobs", "not a [logprob, id, ...] list"]),
    ("output_token_logprobs entry short", _set(OTL + (1,), [-2.0]), V, 1,
     ["not a [logprob, id, ...] list"]),
    ("top-K row a string", _set(TOP + (1,), "xy"), V, 1, ["row is a string, not a list"]),
    ("top-K row an object", _set(TOP + (1,), {"a": 1, "b": 2}), V, 1,
     ["row is an object, not a list"]),
    ("top-K entry an int", _set(TOP + (2, 1), 5), V, 2, ["slot 1", "not a [logprob, id"]),
    # the one-pass transpose (decode.pair_columns) must name odd entries, and cannot be
    # misaligned by entries of other lengths the way a flatten-then-slice could
    ("top-K entry a 3-character string", _set(TOP + (1, 0), "abc"), V, 1,
     ["slot 0", "entry 'abc' is not a [logprob, id"]),
    ("sampled entry an object", _set(OTL + (2,), {"a": -1.0, "b": 7}), V, 2,
     ["output_token_logprobs", "is not a [logprob, id"]),
    ("top-K entries of 2 and 4 items", _all(_set(TOP + (0, 0), [-0.5, 1]),
                                            _set(TOP + (0, 1), [None, -1.5, 2, None])), V, 0,
     ["slot 1", "id -1.5 is a float"]),  # flattened and cut in threes it would read (-1.5, 2)
    ("top-K an object", _set(TOP, {"0": 1, "1": 2, "2": 3}), V, None,
     ["output_top_logprobs is an object, not a list"]),
]


@pytest.mark.parametrize("name, mutate, vocab, position, words", SGLANG_CASES,
                         ids=[c[0] for c in SGLANG_CASES])
def test_sglang_json_hostile(name, mutate, vocab, position, words):
    bad = sglang_body()
    mutate(bad)
    with pytest.raises(RolloutValidationError) as info:
        parse_sglang(bad, vocab)
    _check(info.value, position, words)


def test_the_untouched_bodies_parse():
    """The table's bodies are valid before mutation (so each case tests only its mutation)."""
    a, b = parse_sglang(sglang_body())
    assert b.support_ids.tolist() == [[1, 2, 0], [3, 4, 0], [5, 6, 7]]
    for b64 in (True, False):
        _, f = parse_sglang(flat_body(b64))
        assert torch.equal(f.support_ids, b.support_ids)
    (s,) = parse_scoring(scoring_body())
    assert torch.equal(s.support_ids, b.support_ids)
    assert parse_vllm(vllm_choice()).support_ids.tolist() == [[1, 2, 7], [4, 9, 0]]


def test_deep_nesting_is_malformed_not_recursion_error():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(MalformedResponseError, match="malformed JSON"):
        parse_generate_response(deep, top_logprobs=K)
    with pytest.raises(MalformedResponseError, match="malformed JSON"):
        loads(deep)


def test_messages_of_deep_items_are_short():
    """A deeply nested item or server error (within orjson's depth limit) is reported with a
    bounded preview: its repr used to raise RecursionError."""
    deep = b"[" * 1020 + b"]" * 1020
    with pytest.raises(MalformedResponseError) as info:
        parse_generate_response(b"[" + dumps(sglang_body()) + b", " + deep + b"]",
                                top_logprobs=K, vocab_size=V)
    assert info.value.sample_index == 1 and len(str(info.value)) < 300
    with pytest.raises(MalformedResponseError, match="server error response") as info:
        parse_generate_response(b'{"error": ' + deep + b"}", top_logprobs=K)
    assert len(str(info.value)) < 400


def test_nan_and_inf_everywhere_are_errors_not_values():
    for value in (math.nan, math.inf):
        bad = sglang_body()
        bad["meta_info"]["output_token_logprobs"][0][0] = value
        with pytest.raises(RolloutValidationError, match="sample 1, position 0"):
            parse_sglang(bad)


# ------------------------------------------------------------------- the engines take over

def _tamper(server, mutate):
    """Wraps the fake SGLang server's answer (per request) with `mutate(item)` on item 1."""
    answer = server._answer

    def tampered(body, fault):
        out = answer(body, fault)
        items = out if isinstance(out, list) else [out]
        for i, item in enumerate(items):
            rid = (body.get("rid") or [""] * len(items))[i]
            if rid.endswith(("-s1-a1", "-s1-a2", "-s1-a3")):
                mutate(item)
        return out
    server._answer = tampered


@pytest.mark.parametrize("name, mutate", [
    ("float top-K id (was accepted, truncated)",
     lambda item: item["meta_info"]["output_top_logprobs"][0][0].__setitem__(1, 2.5)),
    ("short output_token_logprobs entry (was an IndexError out of generate)",
     lambda item: item["meta_info"]["output_token_logprobs"].__setitem__(0, [-1.0])),
])
def test_sglang_engine_retries_then_reports_a_failure(server, name, mutate):
    _tamper(server, mutate)
    client = SGLangEngine(server.url, top_logprobs=5, timeout_s=10.0, max_retries=2,
                          backoff_s=0.001, backoff_max_s=0.01, vocab_size=VOCAB)
    batch = client.generate(prompts(1), {"temperature": 1.0, "max_new_tokens": 4}, n=2)
    assert [s.sample_index for s in batch.samples] == [0]
    (failure,) = batch.failures
    assert (failure.sample_index, failure.attempts, failure.kind) == (1, 3, "invalid")
    assert "sample 1, position 0" in failure.error, failure.error
