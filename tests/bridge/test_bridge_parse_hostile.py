"""Hostile engine bodies: every parser returns a validated result or one of the two validation
errors (`RolloutValidationError` / `MalformedResponseError`), naming sample, position and field.

The table holds bodies that used to end in a RecursionError / IndexError / TypeError /
OverflowError / bare ValueError, or were accepted wrong (a top-K id 2**32 + 2 wrapped to 2 in the
int32 support; 2.7 truncated to 2; "4" and "-2.0" coerced; a bool taken as id 1 or logprob 0; a
vLLM sampled logprob that disagrees with its own top-K entry). The fuzz mutates real bodies (deep
nesting, wrong types, huge ints, NaN/inf, missing keys, truncated base64, wrong lengths) and
asserts only "valid result or one of the two errors, naming where". The engine tests check that
the clients' existing handling (retry, then a `RolloutFailure`) takes over.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pybase64
import pytest
import torch
from conftest import VOCAB, TinyLM, prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_bridge import LocalEngine, RolloutValidationError, SGLangEngine, \
    parse_generate_response, parse_scoring_response
from rollout_bridge.core.decode import MalformedResponseError, loads
from rollout_bridge.vllm.parse import parse_completion_choice

V = 10
K = 2
BIG = 2**32 + 2  # wraps to 2 in int32

# ------------------------------------------------------------------------------------ bodies

GOOD_OUT = [(-0.5, 1), (-2.0, 4), (-3.0, 7)]
GOOD_TOP = [[(-0.5, 1), (-1.5, 2)], [(-0.4, 3), (-2.0, 4)], [(-0.3, 5), (-2.5, 6)]]


def sglang_body() -> dict:
    """A valid SGLang /generate item, nested top-K (K=2, vocab 10)."""
    meta = {"id": "x", "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 3,
            "weight_version": "1", "output_token_logprobs": [[lp, i, None] for lp, i in GOOD_OUT],
            "output_top_logprobs": [[[lp, i, None] for lp, i in row] for row in GOOD_TOP],
            "completion_tokens": 3, "cached_tokens": 0}
    return {"output_ids": [i for _, i in GOOD_OUT], "meta_info": meta}


def _b64(arr: np.ndarray) -> str:
    return pybase64.b64encode(arr.tobytes()).decode()


def flat_body(b64: bool = True, side: str = "output") -> dict:
    """The same item with the output top-K as SGLang's flat arrays (b64 or JSON lists)."""
    body = sglang_body()
    meta = body["meta_info"]
    del meta["output_top_logprobs"]
    vals = np.array([[lp for lp, _ in row] for row in GOOD_TOP], dtype="<f4")
    idx = np.array([[i for _, i in row] for row in GOOD_TOP], dtype="<i4")
    if b64:
        meta.update({f"{side}_top_logprobs_val_flat_b64": _b64(vals),
                     f"{side}_top_logprobs_idx_flat_b64": _b64(idx),
                     f"{side}_top_logprobs_val_flat_b64_dtype": "float32",
                     f"{side}_top_logprobs_idx_flat_b64_dtype": "int32"})
    else:
        meta.update({f"{side}_top_logprobs_val_flat": vals.reshape(-1).tolist(),
                     f"{side}_top_logprobs_idx_flat": idx.reshape(-1).tolist()})
    meta.update({f"{side}_top_logprobs_shape": [3, K], f"{side}_top_logprobs_null_prefix": 0})
    return body


def scoring_body() -> dict:
    """A scoring answer for a 2-token prompt + the 3 response tokens: one null row, then 3."""
    body = flat_body(True, side="input")
    body["meta_info"]["input_top_logprobs_null_prefix"] = 1
    body["meta_info"]["output_token_logprobs"] = []
    body["output_ids"] = []
    return body


def vllm_choice() -> dict:
    """A valid vLLM completion choice: pos 0 sampled 7 outside the top-2, pos 1 sampled 4 in."""
    tops = [[(7, -3.0), (1, -0.4), (2, -1.9)], [(4, -0.5), (9, -1.1)]]
    return {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [7, 4],
            "prompt_token_ids": [1, 2],
            "logprobs": {"token_logprobs": [-3.0, -0.5],
                         "top_logprobs": [{f"token_id:{i}": v for i, v in t} for t in tops]}}


def dumps(obj) -> bytes:
    """JSON with what orjson cannot write (ints beyond 64 bits, NaN / Infinity)."""
    return json.dumps(obj).encode()


def parse_sglang(bad: dict, vocab=V) -> list:
    """[good, bad] as one batched body: errors must name sample 1."""
    return parse_generate_response(dumps([sglang_body(), bad]), top_logprobs=K,
                                   vocab_size=vocab)


def parse_scoring(bad: dict) -> list:
    (s,) = parse_generate_response(dumps(sglang_body()), top_logprobs=0, vocab_size=V,
                                   validate=False)
    s.prompt_ids = torch.tensor([1, 2])
    return parse_scoring_response(dumps([bad]), [s], K, V, sample_indices=[1])


def parse_vllm(bad: dict) -> object:
    return parse_completion_choice(loads(dumps(bad)), K, V, sample_index=1)


# ------------------------------------------------------------------------------------- table

def _meta(b):
    return b["meta_info"]


def _set(path, value):
    """A mutation that sets body[path...] = value."""
    def mutate(b):
        node = b
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _all(*mutations):
    def mutate(b):
        for m in mutations:
            m(b)
    return mutate


M, OTL, TOP = "meta_info", ("meta_info", "output_token_logprobs"), \
    ("meta_info", "output_top_logprobs")

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

FLAT = ("meta_info", "output_top_logprobs")
FLAT_CASES = [
    ("shape of strings", True, _set((M, "output_top_logprobs_shape"), ["3", 2]), None,
     ["output_top_logprobs_shape", "is not [rows, k]"]),
    ("shape negative", True, _set((M, "output_top_logprobs_shape"), [-1, -6]), None,
     ["is not [rows, k]"]),
    ("shape an int", True, _set((M, "output_top_logprobs_shape"), 6), None,
     ["is not [rows, k]"]),
    ("null_prefix a string", True, _set((M, "output_top_logprobs_null_prefix"), "0"), None,
     ["null_prefix '0' is not a non-negative integer"]),
    ("null_prefix a float", True, _set((M, "output_top_logprobs_null_prefix"), 0.5), None,
     ["null_prefix 0.5"]),
    ("null_prefix a list", True, _set((M, "output_top_logprobs_null_prefix"), []), None,
     ["null_prefix []"]),
    ("base64 truncated", True, lambda b: _meta(b).__setitem__(
        "output_top_logprobs_val_flat_b64", _meta(b)["output_top_logprobs_val_flat_b64"][:-3]),
     None, ["output_top_logprobs_val_flat_b64 is not valid base64"]),
    ("base64 with a foreign character", True, lambda b: _meta(b).__setitem__(
        "output_top_logprobs_idx_flat_b64", "!" + _meta(b)["output_top_logprobs_idx_flat_b64"]),
     None, ["output_top_logprobs_idx_flat_b64 is not valid base64"]),
    ("base64 not a string", True, _set((M, "output_top_logprobs_val_flat_b64"), 5), None,
     ["output_top_logprobs_val_flat_b64 is not a base64 string"]),
    ("base64 of 7 bytes", True, _set((M, "output_top_logprobs_idx_flat_b64"),
                                     _b64(np.zeros(7, np.uint8))), None,
     ["has 7 bytes, not a whole number of int32"]),
    ("dtype object", True, _set((M, "output_top_logprobs_val_flat_b64_dtype"), "object"), None,
     ["_dtype 'object' is not one of"]),
    ("id dtype float32 (truncated ids)", True, _all(
        _set((M, "output_top_logprobs_idx_flat_b64_dtype"), "float32"),
        _set((M, "output_top_logprobs_idx_flat_b64"),
             _b64(np.array([1, 2, 3, 4, 5, 6], "<f4")))), None, ["_dtype 'float32'"]),
    ("id int64 2**32+2 wraps to 2", True, _all(
        _set((M, "output_top_logprobs_idx_flat_b64_dtype"), "int64"),
        _set((M, "output_top_logprobs_idx_flat_b64"),
             _b64(np.array([1, BIG, 3, 4, 5, 6], "<i8")))), 0,
     ["support_ids slot 1", str(BIG), "does not fit int32"]),
    ("JSON id float 2.7", False, _set((M, "output_top_logprobs_idx_flat", 1), 2.7), 0,
     ["output_top_logprobs_idx_flat slot 1", "2.7", "a float"]),
    ("JSON id 2**32+2", False, _set((M, "output_top_logprobs_idx_flat", 1), BIG), 0,
     ["support_ids slot 1", "does not fit int32"]),
    ("JSON logprob string", False, _set((M, "output_top_logprobs_val_flat", 3), "-2.0"), 1,
     ["output_top_logprobs_val_flat slot 1", "'-2.0'", "a string"]),
]

SCORING_CASES = [
    ("null_prefix -2**70", _set((M, "input_top_logprobs_null_prefix"), -2**70), None,
     ["input_top_logprobs_null_prefix", "is not a non-negative integer"]),
    ("id int64 2**32+2 wraps to 2", _all(
        _set((M, "input_top_logprobs_idx_flat_b64_dtype"), "int64"),
        _set((M, "input_top_logprobs_idx_flat_b64"),
             _b64(np.array([1, BIG, 3, 4, 5, 6], "<i8")))), 0,
     ["support_ids slot 1", "does not fit int32"]),
]

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


def _check(err: RolloutValidationError, position, words):
    assert err.sample_index == 1, str(err)
    assert err.position == position, str(err)
    where = "sample 1" + ("" if position is None else f", position {position}")
    assert str(err).startswith(where + ": "), str(err)
    for w in words:
        assert w in str(err), (w, str(err))


@pytest.mark.parametrize("name, mutate, vocab, position, words", SGLANG_CASES,
                         ids=[c[0] for c in SGLANG_CASES])
def test_sglang_json_hostile(name, mutate, vocab, position, words):
    bad = sglang_body()
    mutate(bad)
    with pytest.raises(RolloutValidationError) as info:
        parse_sglang(bad, vocab)
    _check(info.value, position, words)


@pytest.mark.parametrize("name, b64, mutate, position, words", FLAT_CASES,
                         ids=[c[0] for c in FLAT_CASES])
def test_sglang_flat_hostile(name, b64, mutate, position, words):
    bad = flat_body(b64)
    mutate(bad)
    with pytest.raises(RolloutValidationError) as info:
        parse_sglang(bad)
    _check(info.value, position, words)


@pytest.mark.parametrize("name, mutate, position, words", SCORING_CASES,
                         ids=[c[0] for c in SCORING_CASES])
def test_scoring_hostile(name, mutate, position, words):
    bad = scoring_body()
    mutate(bad)
    with pytest.raises(RolloutValidationError) as info:
        parse_scoring(bad)
    _check(info.value, position, words)


@pytest.mark.parametrize("name, mutate, position, words", VLLM_CASES,
                         ids=[c[0] for c in VLLM_CASES])
def test_vllm_hostile(name, mutate, position, words):
    bad = vllm_choice()
    mutate(bad)
    with pytest.raises(RolloutValidationError) as info:
        parse_vllm(bad)
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


# -------------------------------------------------------------------------------------- fuzz

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
