"""Shared hostile-body helpers: valid bodies of every transport (SGLang nested JSON, flat b64 /
JSON lists, scoring, vLLM), the mutation helpers of the tables and the error check.

Used by test_bridge_parse_hostile*.py and test_bridge_parse_fuzz.py.
"""

from __future__ import annotations

import json

import numpy as np
import pybase64
import torch

from rollout_bridge import RolloutValidationError, parse_generate_response, parse_scoring_response
from rollout_bridge.core.decode import loads
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


def _check(err: RolloutValidationError, position, words):
    assert err.sample_index == 1, str(err)
    assert err.position == position, str(err)
    where = "sample 1" + ("" if position is None else f", position {position}")
    assert str(err).startswith(where + ": "), str(err)
    for w in words:
        assert w in str(err), (w, str(err))
