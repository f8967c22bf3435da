"""Response bodies: sglang's own TokenizerManager formatting vs the fake's (tests/support/
sglang_format.py), and our parsers on the real bodies (both versions, marker sglang_api).

The box's report holds, per scenario, the request our client builds, the arrays the CPU scheduler
handed to sglang's real `TokenizerManager._handle_batch_output`, and the raw HTTP body sglang's
real handler answered with. Rebuilding the body from the same arrays with `sglang_format` must give
the same JSON (timing fields aside); the real bodies must parse with our client's parsers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import sglang_format as fmt

from rollout_bridge.sglang.parse import parse_response_object
from rollout_bridge.sglang.parse_flat import decode_flat_topk, scoring_rows
from rollout_bridge.core.types import RolloutValidationError

pytestmark = pytest.mark.sglang_api

SCENARIOS = ("json_T1.0", "flat_b64_T1.0", "scoring_b64_T1.0", "scoring_T1.0", "json_T0.0",
             "flat_json_T1.0", "flat_b64_ragged", "prompt_side_nested")


def _rebuild(scenario: dict, real_items: list) -> list:
    body = scenario["request"]
    rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
    out = []
    for rid, real in zip(rids, real_items):
        cap = scenario["scheduler"][rid]
        x = cap["arrays"]
        meta = fmt.meta_info(
            rid=rid, finish_reason=x["finish"], prompt_tokens=len(cap["input_ids"]),
            weight_version=real["meta_info"]["weight_version"], request=body,
            out_lp=x["output_token_logprobs_val"], out_ids=x["output_token_logprobs_idx"],
            out_top_v=x["output_top_logprobs_val"], out_top_i=x["output_top_logprobs_idx"],
            in_lp=x["input_token_logprobs_val"], in_ids=x["input_token_logprobs_idx"],
            in_top_v=x["input_top_logprobs_val"], in_top_i=x["input_top_logprobs_idx"],
            completion_tokens=len(x["ids"]))
        out.append(fmt.response_object(x["ids"], meta))
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_fake_formatting_equals_sglang(report, name):
    sc = report["scenarios"][name]
    assert sc["status"] == 200, sc["raw"][:500]
    real = json.loads(sc["raw"])
    assert isinstance(real, list)
    rebuilt = _rebuild(sc, real)
    assert fmt.strip_volatile(rebuilt) == fmt.strip_volatile(real)
    for item in real:
        assert "text" not in item  # --skip-tokenizer-init
        assert set(fmt.VOLATILE_META_KEYS) <= set(item["meta_info"])


def test_ragged_output_falls_back_to_nested(report):
    real = json.loads(report["scenarios"]["flat_b64_ragged"]["raw"])
    for item in real:
        assert "output_top_logprobs" in item["meta_info"]
        assert "output_top_logprobs_val_flat_b64" not in item["meta_info"]


@pytest.mark.parametrize("name", ["json_T1.0", "flat_b64_T1.0", "flat_json_T1.0"])
def test_real_generate_bodies_parse(report, name):
    sc = report["scenarios"][name]
    k = sc["request"]["top_logprobs_num"]
    for j, obj in enumerate(json.loads(sc["raw"])):
        s = parse_response_object(obj, k, 50, j, validate=True)
        assert s.num_tokens == len(obj["output_ids"]) > 0
        assert s.support_ids.shape == (s.num_tokens, k + 1)


def test_real_scoring_body_covers_exactly_the_response(report):
    sc = report["scenarios"]["scoring_T1.0"]
    body = sc["request"]
    start = body["logprob_start_len"]
    for j, (obj, ids) in enumerate(zip(json.loads(sc["raw"]), body["input_ids"])):
        vals_rk, idx_rk, null_prefix = decode_flat_topk(obj["meta_info"], j)
        prompt_len = start + 1
        t = len(ids) - prompt_len
        assert null_prefix == 1  # SGLang's null row at logprob_start_len
        rows = scoring_rows(prompt_len, t, start, null_prefix, j)
        assert rows.tolist() == list(range(t)) and vals_rk.shape[0] == t
        # row r is the untempered distribution of response token r, computed by the scheduler
        cap = sc["scheduler"][body["rid"][j]]["arrays"]
        np.testing.assert_array_equal(idx_rk, np.asarray(cap["input_top_logprobs_idx"][1:]))
        # the old request (logprob_start_len = len(prompt)) does not cover the first token
        with pytest.raises(RolloutValidationError, match="first response token"):
            scoring_rows(prompt_len, t, prompt_len, null_prefix, j)


def test_prompt_side_rows_start_with_a_null_row(report):
    sc = report["scenarios"]["prompt_side_nested"]
    meta = json.loads(sc["raw"])[0]["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None
    start = sc["request"]["logprob_start_len"]
    assert len(meta["input_token_logprobs"]) == len(sc["request"]["input_ids"][0]) - start
