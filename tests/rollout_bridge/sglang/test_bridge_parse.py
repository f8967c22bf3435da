"""Parser tests: the recorded-shape fixture, support folding (hypothesis) and validation errors.

Compares parse_generate_response against hand-derived expectations (fixture) and against a
straightforward per-position Python reference of docs/math.md §3.9 (hypothesis), exactly.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bridge import RolloutValidationError, parse_generate_response
from rollout_bridge.sglang.parse import MalformedResponseError

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "sglang_generate_k3.json")


def _body(outputs, tops, output_ids=None, **meta):
    """One response object from [(lp, id)] and [[(lp, id)]] (None rows allowed)."""
    m = {"id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": 3,
         "completion_tokens": len(outputs), "cached_tokens": 0, "weight_version": "1",
         "e2e_latency": 0.1, "output_token_logprobs": [[lp, i, None] for lp, i in outputs],
         "output_top_logprobs": None if tops is None else [
             None if row is None else [[lp, i, None] for lp, i in row] for row in tops]}
    m.update(meta)
    ids = [i for _, i in outputs] if output_ids is None else output_ids
    return {"text": "", "output_ids": ids, "meta_info": m}


def test_fixture_layout():
    with open(ASSET, "rb") as f:
        samples = parse_generate_response(f.read(), top_logprobs=3, vocab_size=151936)
    assert len(samples) == 2
    s0, s1 = samples
    assert s0.finish_reason == "stop" and s1.finish_reason == "length"
    assert s0.support_ids.dtype.is_floating_point is False and str(s0.support_ids.dtype) == \
        "torch.int32"
    assert s0.support_ids.shape == (3, 4) and s1.support_ids.shape == (2, 4)
    # Sample 0, position 1: the top-K contains a *valid* id 0; the sampled id 13 is in slot 1.
    assert s0.support_ids[1].tolist() == [0, 13, 11, 0]
    assert s0.support_valid[1].tolist() == [True, True, True, False]
    assert s0.support_logprobs[1, 3].item() == -math.inf
    # Sample 1, position 0: sampled token outside the top-K -> slot K.
    assert s1.support_ids[0].tolist() == [12095, 279, 264, 55120]
    assert s1.support_valid[0].all()
    assert s1.support_logprobs[0, 3].item() == pytest.approx(-6.2514)
    # Sample 1, position 1: short list (2 of 3) -> invalid slot 2; sampled id 2 inside, its slot
    # carries the sampled logprob -1.0, not the top-list copy -1.00003.
    assert s1.support_valid[1].tolist() == [True, True, False, False]
    assert s1.support_logprobs[1, 1].item() == -1.0
    assert s1.support_logprobs[1, 2].item() == -math.inf
    assert s1.meta_info["num_short_positions"] == 1
    assert s1.meta_info["num_missing_topk_slots"] == 1
    assert s1.meta_info["weight_version"] == "7"
    assert s1.behavior_logprob.tolist() == pytest.approx([-6.2514, -1.0])
    assert s0.response_ids.tolist() == [12095, 13, 151645]


def _reference(outputs, tops, k):
    """Per-position Python version of the §3.9 layout."""
    t = len(outputs)
    ids = np.zeros((t, k + 1), np.int64)
    lps = np.full((t, k + 1), -np.inf)
    valid = np.zeros((t, k + 1), bool)
    for p, ((slp, sid), row) in enumerate(zip(outputs, tops)):
        row = sorted(row or [], key=lambda e: -e[0])[:k]
        found = False
        for j, (lp, i) in enumerate(row):
            ids[p, j], lps[p, j], valid[p, j] = i, lp, True
            if i == sid:
                lps[p, j], found = slp, True
        if not found:
            ids[p, k], lps[p, k], valid[p, k] = sid, slp, True
    return ids, lps, valid


@st.composite
def _case(draw):
    vocab = draw(st.integers(8, 40))
    k = draw(st.integers(1, 6))
    t = draw(st.integers(0, 8))
    outputs, tops = [], []
    for _ in range(t):
        n = draw(st.integers(0, min(k, vocab)))
        ids = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n, unique=True))
        # distinct, decreasing probabilities with total mass <= 0.9
        mass = sorted(draw(st.lists(st.floats(0.001, 0.9 / max(n, 1)), min_size=n,
                                    max_size=n, unique=True)), reverse=True)
        row = [(float(np.float32(math.log(m))), i) for m, i in zip(mass, ids)]
        if row and draw(st.booleans()):
            j = draw(st.integers(0, len(row) - 1))
            sampled = (row[j][0], row[j][1])
        else:
            free = [i for i in range(vocab) if i not in ids]
            sampled = (math.log(0.05), draw(st.sampled_from(free)))
        outputs.append(sampled)
        tops.append(None if (n == 0 and draw(st.booleans())) else row)
    return vocab, k, outputs, tops


@settings(max_examples=150, deadline=None)
@given(_case())
def test_folding_matches_reference(case):
    vocab, k, outputs, tops = case
    (s,) = parse_generate_response(orjson.dumps(_body(outputs, tops)), top_logprobs=k,
                                   vocab_size=vocab)
    ids, lps, valid = _reference(outputs, tops, k)
    assert s.support_valid.numpy().tolist() == valid.tolist()
    np.testing.assert_array_equal(np.where(valid, s.support_ids.numpy(), -1),
                                  np.where(valid, ids, -1))
    np.testing.assert_allclose(s.support_logprobs.numpy(), lps.astype(np.float32))
    # invalid slots: id 0, logprob -inf, never 0
    assert (s.support_ids.numpy()[~valid] == 0).all()
    assert np.isneginf(s.support_logprobs.numpy()[~valid]).all()
    # the sampled token is a valid support entry exactly once at every position
    sampled = np.array([i for _, i in outputs], dtype=np.int64).reshape(-1, 1)
    assert ((s.support_ids.numpy() == sampled) & valid).sum(1).tolist() == [1] * len(outputs)
    short = sum(1 for row in tops if row is None or len(row) < k)
    assert s.meta_info["num_short_positions"] == short


def test_unsorted_topk_is_put_in_rank_order():
    body = _body([(-2.0, 5)], [[(-3.0, 1), (-0.5, 2), (-2.0, 5)]])
    (s,) = parse_generate_response(orjson.dumps(body), top_logprobs=3, vocab_size=10)
    assert s.support_ids[0].tolist() == [2, 5, 1, 0]


def test_k0_sampled_only():
    body = _body([(-0.5, 4), (-0.1, 1)], None)
    (s,) = parse_generate_response(orjson.dumps(body), top_logprobs=0)
    assert s.support_ids.tolist() == [[4], [1]] and s.support_valid.all()


def test_stdlib_json_neg_infinity_becomes_invalid_slot():
    body = _body([(-0.5, 4)], [[(-0.5, 4), (-1.0, 2)]])
    body["meta_info"]["output_top_logprobs"][0][1][0] = float("-inf")
    (s,) = parse_generate_response(json.dumps(body), top_logprobs=2, vocab_size=10)
    assert s.support_valid[0].tolist() == [True, False, False]
    assert s.meta_info["num_neg_inf_slots"] == 1


def _err(body, k=3, vocab=10) -> RolloutValidationError:
    with pytest.raises(RolloutValidationError) as info:
        parse_generate_response(orjson.dumps(body) if not isinstance(body, bytes) else body,
                                top_logprobs=k, vocab_size=vocab)
    return info.value


GOOD_TOP = [[(-0.5, 1), (-1.5, 2)], [(-0.4, 3), (-2.0, 4)], [(-0.3, 5), (-2.5, 6)]]
GOOD_OUT = [(-0.5, 1), (-2.0, 4), (-3.0, 7)]


def test_good_case_parses():
    parse_generate_response(orjson.dumps(_body(GOOD_OUT, GOOD_TOP)), top_logprobs=2, vocab_size=10)


@pytest.mark.parametrize("mutate, position, words", [
    (lambda b: b["output_ids"].pop(), 2, "output_ids has 2"),
    (lambda b: b["meta_info"]["output_top_logprobs"].pop(), 2, "output_top_logprobs has 2"),
    (lambda b: b["output_ids"].__setitem__(1, 9), 1, "sampled id mismatch"),
    (lambda b: b["meta_info"].__setitem__("output_top_logprobs", None), 0, "missing"),
    (lambda b: b["meta_info"]["output_top_logprobs"][2].__setitem__(1, [-2.5, 10, None]), 2,
     "out of range [0, 10)"),
    (lambda b: b["meta_info"]["output_top_logprobs"][1].__setitem__(1, [-2.0, -1, None]), 1,
     "out of range"),
    (lambda b: b["meta_info"]["output_top_logprobs"][1].__setitem__(1, [-2.0, 3, None]), 1,
     "duplicate valid id 3"),
    (lambda b: b["meta_info"]["output_top_logprobs"][2].__setitem__(0, [None, 5, None]), 2,
     "NaN"),
    (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(0, None), 1,
     "not finite"),
    (lambda b: b["meta_info"]["output_top_logprobs"][0].__setitem__(1, [-0.6, 2, None]), 0,
     "sum of behavior probabilities"),
])
def test_validation_errors_name_sample_and_position(mutate, position, words):
    good = _body(GOOD_OUT, GOOD_TOP)
    bad = _body(GOOD_OUT, GOOD_TOP)
    mutate(bad)
    err = _err([good, bad], k=2)
    assert err.sample_index == 1 and err.position == position, str(err)
    assert f"sample 1, position {position}" in str(err) and words in str(err)


def test_validation_error_is_value_error_and_malformed():
    assert issubclass(RolloutValidationError, ValueError)
    with pytest.raises(MalformedResponseError):
        parse_generate_response(b'{"text": "x", "meta_info": {', top_logprobs=2)
    with pytest.raises(MalformedResponseError):
        parse_generate_response(b'{"error": {"message": "bad"}}', top_logprobs=2)


def test_sum_mu_tolerance():
    # total mass 1 + 5e-5 is tolerated (rounding), 1 + 2e-4 is not
    lp_a, lp_b = math.log(0.6), math.log(0.4 + 5e-5)
    parse_generate_response(orjson.dumps(_body([(lp_a, 1)], [[(lp_a, 1), (lp_b, 2)]])),
                            top_logprobs=2, vocab_size=10)
    lp_b = math.log(0.4 + 2e-4)
    err = _err(_body([(lp_a, 1)], [[(lp_a, 1), (lp_b, 2)]]), k=2)
    assert err.position == 0


def _flat_output_body(null_prefix: int, k: int, b64: bool) -> tuple[dict, list, list]:
    """A 4-token response whose output top-K comes in SGLang's flat form (rows after the null
    prefix); returns (body, sampled ids, [4][k] nested rows for the same data)."""
    import pybase64

    ids = [[9, 4, 2][:k], [1, 5, 6][:k], [3, 8, 7][:k], [2, 9, 1][:k]]
    lps = [[-0.3, -2.0, -3.0][:k], [-0.5, -1.5, -2.5][:k], [-0.1, -3.0, -4.0][:k],
           [-0.3, -2.2, -2.9][:k]]
    sampled = [9, 5, 8, 4]
    slp = [-0.3, -1.5, -3.0, -5.0]
    meta = {"finish_reason": {"type": "length"}, "weight_version": "3",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(slp, sampled)]}
    rows_v = np.asarray(lps[null_prefix:], dtype="<f4").reshape(4 - null_prefix, k)
    rows_i = np.asarray(ids[null_prefix:], dtype="<i4").reshape(4 - null_prefix, k)
    if b64:
        meta["output_top_logprobs_val_flat_b64"] = pybase64.b64encode(rows_v.tobytes()).decode()
        meta["output_top_logprobs_idx_flat_b64"] = pybase64.b64encode(rows_i.tobytes()).decode()
    else:
        meta["output_top_logprobs_val_flat"] = rows_v.reshape(-1).tolist()
        meta["output_top_logprobs_idx_flat"] = rows_i.reshape(-1).tolist()
    meta["output_top_logprobs_shape"] = [4 - null_prefix, k]
    meta["output_top_logprobs_null_prefix"] = null_prefix
    nested = [None if p < null_prefix else [[float(np.float32(v)), i, None]
                                            for v, i in zip(lps[p], ids[p])] for p in range(4)]
    return {"output_ids": sampled, "meta_info": meta}, sampled, nested


@pytest.mark.parametrize("b64", [True, False])
@pytest.mark.parametrize("null_prefix,k", [(0, 3), (1, 3), (0, 2)])
def test_flat_output_topk_equals_nested(b64, null_prefix, k):
    body, sampled, nested = _flat_output_body(null_prefix, k, b64)
    (flat,) = parse_generate_response(orjson.dumps(body), top_logprobs=3, vocab_size=10)
    nested_body = {"output_ids": sampled, "meta_info": {
        **{key: v for key, v in body["meta_info"].items() if "flat" not in key
           and "shape" not in key and "null_prefix" not in key},
        "output_top_logprobs": nested}}
    (ref,) = parse_generate_response(orjson.dumps(nested_body), top_logprobs=3, vocab_size=10)
    for name in ("support_ids", "support_logprobs", "support_valid", "behavior_logprob"):
        assert torch.equal(getattr(flat, name), getattr(ref, name)), name
    assert flat.meta_info["num_short_positions"] == ref.meta_info["num_short_positions"]


def test_flat_output_topk_length_mismatch_names_position():
    body, _, _ = _flat_output_body(0, 3, True)
    body["meta_info"]["output_top_logprobs_shape"] = [3, 3]
    body["meta_info"]["output_top_logprobs_val_flat_b64"] = body["meta_info"][
        "output_top_logprobs_val_flat_b64"][:16]  # 3 rows x 3 fp32 = 36 bytes -> 48 b64 chars
    with pytest.raises(RolloutValidationError):
        parse_generate_response(orjson.dumps(body), top_logprobs=3, vocab_size=10)
