"""Fuzz of every parser: real bodies mutated (deep nesting, wrong types, huge ints, NaN/inf,
missing keys, truncated base64, wrong lengths); asserts only "valid result or one of the two
errors (`RolloutValidationError` / `MalformedResponseError`), naming where". Shared bodies:
hostile_bodies.py.
"""

from __future__ import annotations

import copy
import json

import torch
from hostile_bodies import K, V, dumps, flat_body, scoring_body, sglang_body, vllm_choice
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bridge import RolloutValidationError, parse_generate_response, parse_scoring_response
from rollout_bridge.core.decode import MalformedResponseError, loads
from rollout_bridge.vllm.parse import parse_completion_choice

def _paths(node, path=()):
    """Every (path) inside a JSON tree, the root excluded."""
    out = []
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return out
    for key, child in items:
        out.append(path + (key,))
        out.extend(_paths(child, path + (key,)))
    return out


DEEP = "__deep__"
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.just(DEEP),
    st.integers(-2**70, 2**70), st.sampled_from([2**31, 2**32 + 2, -2**31 - 1, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([13.7, 2.0, -0.0, 1e308]),
    st.text(max_size=6), st.sampled_from(["13", "-2.6", "token_id:1", "", "AAAA", "float32"]),
    st.lists(st.integers(-3, 12), max_size=4), st.dictionaries(st.text(max_size=3),
                                                               st.integers(), max_size=2))


def _mutate(body, data):
    """1-3 random edits: replace a node by a hostile value, delete it, truncate / extend a list or
    string (base64 included), or duplicate a list entry."""
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(body)
        if not paths:
            return body
        path = data.draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        node = parent[key]
        op = data.draw(st.sampled_from(["replace", "delete", "shorten", "extend"]))
        if op == "replace":
            parent[key] = data.draw(HOSTILE)
        elif op == "delete":
            del parent[key]
        elif op == "shorten" and isinstance(node, (list, str)) and node:
            parent[key] = node[:data.draw(st.integers(0, len(node) - 1))]
        elif op == "extend" and isinstance(node, list) and node:
            node.append(copy.deepcopy(node[data.draw(st.integers(0, len(node) - 1))]))
        elif op == "extend" and isinstance(node, str):
            parent[key] = node + data.draw(st.sampled_from(["A", "=", "!", "AAAA"]))
    return body


def _encode(obj) -> bytes:
    text = json.dumps(obj)  # NaN/Infinity and ints beyond 64 bits included
    return text.replace(json.dumps(DEEP), "[" * 3000 + "]" * 3000).encode()


def _assert_total(call, t_max: int | None = None):
    """`call()` gives valid samples or one of the two errors, naming sample 1 (or unparsable
    JSON)."""
    try:
        samples = call()
    except RolloutValidationError as err:
        assert str(err), "empty message"
        if err.sample_index is None:
            assert isinstance(err, MalformedResponseError) and "malformed JSON" in str(err)
        else:
            assert err.sample_index == 1 and str(err).startswith("sample 1"), str(err)
        return
    for s in samples if isinstance(samples, list) else [samples]:
        t = s.num_tokens
        assert s.support_ids.dtype == torch.int32 and s.support_ids.shape == (t, K + 1)
        ids = s.support_ids[s.support_valid]
        assert ((ids >= 0) & (ids < V)).all()
        assert ((s.response_ids >= 0) & (s.response_ids < V)).all()
        assert torch.isfinite(s.support_logprobs[s.support_valid]).all()


FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.data(), st.sampled_from(["nested", "flat_b64", "flat_json"]))
def test_fuzz_sglang_generate(data, kind):
    bad = sglang_body() if kind == "nested" else flat_body(kind == "flat_b64")
    bad = _mutate(bad, data)
    raw = _encode([sglang_body(), bad])
    _assert_total(lambda: parse_generate_response(raw, top_logprobs=K, vocab_size=V))


@FUZZ
@given(st.data())
def test_fuzz_sglang_scoring(data):
    bad = _mutate(scoring_body(), data)
    (s,) = parse_generate_response(dumps(sglang_body()), top_logprobs=0, vocab_size=V,
                                   validate=False)
    s.prompt_ids = torch.tensor([1, 2])
    raw = _encode([bad])
    _assert_total(lambda: parse_scoring_response(raw, [s], K, V, sample_indices=[1]))


@FUZZ
@given(st.data())
def test_fuzz_vllm_choice(data):
    raw = _encode(_mutate(vllm_choice(), data))

    def call():
        try:
            choice = loads(raw)
        except MalformedResponseError as err:  # the client reads the body with the same loads
            raise MalformedResponseError(str(err), 1) from None
        return parse_completion_choice(choice, K, V, sample_index=1)
    _assert_total(call)
