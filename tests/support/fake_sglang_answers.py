"""The answers of the fake SGLang server (tests/support/fake_sglang.py) to one /generate item:
a sampled response (`generated`) or a prefill-only score (`scored`), and the faults a test can
put into them (`Fault`, chosen per sample by `parse_rid` of the client's request id).

Bodies are built by `sglang_format` (SGLang's own formatting, checked against the installed
sglang by tests/rollout_bridge/sglang/test_sglang_formatting.py); the numbers come from the server's
`LocalEngine`, under the server's lock.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import torch

import sglang_format as fmt

_RID = re.compile(r"-p(\d+)-s(\d+)-a(\d+)")


def parse_rid(rid: str) -> tuple[int, int, int]:
    """(prompt_index, sample_index, attempt) from an `SGLangEngine` request id."""
    m = _RID.search(rid)
    if m is None:
        raise ValueError(rid)
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@dataclasses.dataclass
class Fault:
    """Fault for one /generate request.

    Attributes:
        kind: None, "delay" (sleep delay_s first), "http500", "http400", "drop" (close the
            connection without a response), "malformed" (truncated JSON body), "not_list" (an
            object instead of the batch list).
        delay_s: Sleep before answering (any kind).
        abort_items: Sample indices (from the rid; else item positions) answered with
            finish_reason abort (partial output).
        ragged_items: Sample indices whose top-K lists are shortened at some positions.
        corrupt_items: Sample indices whose output_ids disagree with output_token_logprobs.
        inf_items: Sample indices whose first top-K logprob is +inf.
    """

    kind: str | None = None
    delay_s: float = 0.0
    abort_items: tuple[int, ...] = ()
    ragged_items: tuple[int, ...] = ()
    corrupt_items: tuple[int, ...] = ()
    inf_items: tuple[int, ...] = ()


def generated(server, prompt: list[int], params: dict, body: dict, rid: str, fault: Fault,
              key: int) -> tuple[list[int], dict]:
    """One sampled item of a /generate request: (output_ids, meta_info), `fault` applied to
    sample `key`."""
    k = int(body.get("top_logprobs_num") or 0)
    gen_params = {p: v for p, v in params.items() if p != "n"}
    with server._lock:
        if server.deterministic_seeds:
            server.engine._calls = zlib.crc32(repr((list(prompt), key)).encode())
        saved_k = server.engine.top_logprobs
        server.engine.top_logprobs = max(k, 0)
        try:
            s = server.engine.generate([prompt], gen_params, n=1).samples[0]
        finally:
            server.engine.top_logprobs = saved_k
    resp = s.response_ids.tolist()
    lp = s.behavior_logprob.tolist()
    t = len(resp)
    finish = fmt.finish_stop(resp[-1]) if s.finish_reason == "stop" else fmt.finish_length(t)
    # the engine's raw top-K (the first K slots of the folded support, invalid slots dropped)
    ids_ts, lp_ts = s.support_ids.tolist(), s.support_logprobs.tolist()
    top_v = [lp_ts[q][:k] for q in range(t)]
    top_i = [ids_ts[q][:k] for q in range(t)]
    if key in fault.abort_items:
        cut = t // 2
        resp, lp, top_v, top_i, t = resp[:cut], lp[:cut], top_v[:cut], top_i[:cut], cut
        finish = fmt.finish_abort()
    if key in fault.ragged_items and k:
        for q in range(0, t, 3):
            keep = max(0, k - 1 - q % 4)
            top_v[q], top_i[q] = top_v[q][:keep], top_i[q][:keep]
    if key in fault.inf_items and k and t:
        top_v[0] = [float("inf")] + top_v[0][1:]
    output_ids = list(resp)
    if key in fault.corrupt_items and t:
        output_ids[-1] = (output_ids[-1] + 1) % server.engine.vocab_size
    meta = fmt.meta_info(rid=rid, finish_reason=finish, prompt_tokens=len(prompt),
                         weight_version=server.engine.weight_version(), request=body,
                         out_lp=lp, out_ids=resp, out_top_v=top_v, out_top_i=top_i,
                         completion_tokens=t)
    return output_ids, meta

def scored(server, input_ids: list[int], params: dict, body: dict, rid: str
           ) -> tuple[list[int], dict]:
    """Prefill-only request: prompt rows from logprob_start_len (a null row first), the
    untempered log_softmax like SGLang's prompt side (logprob_processor.py:734)."""
    k = int(body.get("top_logprobs_num") or 0)
    with server._lock:
        lp_lv = server.engine.score(input_ids, 1.0)  # row q: distribution of token q+1
    start = body.get("logprob_start_len")
    length = len(input_ids)
    start = length if start is None or start < 0 else int(start)
    if start >= length:  # SGLang's scheduler aborts such a request (scheduler.py:3275)
        meta = fmt.meta_info(rid=rid, finish_reason=fmt.finish_abort(
            "logprob_start_len is larger than the input length"), prompt_tokens=length,
            weight_version=server.engine.weight_version(), request=body)
        return [], meta
    tok = torch.as_tensor(input_ids, dtype=torch.int64)
    row_vals, top_v, top_i = {}, {}, {}
    for q in range(start + 1, length):
        dist_v = lp_lv[q - 1]
        row_vals[q] = float(dist_v[tok[q]])
        if k:
            vals, idx = torch.topk(dist_v, k)
            top_v[q], top_i[q] = vals.tolist(), idx.tolist()
    tv, ti, trv, tri = fmt.prompt_rows(input_ids, start, row_vals, None, top_v if k else None,
                                       top_i if k else None)
    meta = fmt.meta_info(rid=rid, finish_reason=fmt.finish_length(0), prompt_tokens=length,
                         weight_version=server.engine.weight_version(), request=body,
                         in_lp=tv, in_ids=ti, in_top_v=trv, in_top_i=tri)
    return [], meta
