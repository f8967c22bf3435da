"""Hostile engine bodies, SGLang flat top-K (base64 arrays and JSON lists) and scoring responses:
a validated result or one of the two validation errors, naming sample, position and field (a
flat id int64 2**32 + 2 used to wrap to 2 in the int32 support). Shared bodies: hostile_bodies.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hostile_bodies import BIG, M, _all, _b64, _check, _meta, _set, flat_body, parse_scoring, \
    parse_sglang, scoring_body

from rollout_bridge import RolloutValidationError

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
