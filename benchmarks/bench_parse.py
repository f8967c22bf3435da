"""Benchmark: SGLang top-K responses (K=20, 8k tokens) -> rollout samples.

Compares, in one run on the same synthetic but realistically shaped bodies (the SGLang
response shapes of docs/engines.md):
  floor     one orjson.loads of the nested /generate body with the cyclic GC paused (any JSON
            path pays this); also shown with the GC running
  ours-json rollout_bridge.parse_generate_response (orjson + C-level flattening + numpy)
  baseline  stdlib json + per-position Python loops + torch.tensor (the DPPO/Stable-RL way)
  ours-flat binary path, one request: the /generate body with the output top-K as SGLang's
            flat base64 arrays (`return_flat_raw_output_top_logprobs`), parse_generate_response
  ours-b64  binary path, two requests: generation body with K=0 + scoring body with flat base64
            prompt-side top-K (parse_generate_response + parse_scoring_response)
Rows are timed round-robin (every row once per round), so their ratios hold on a loaded machine;
reports medians, minima and ratios. Usage: python benchmarks/bench_parse.py [--tokens 8192 --k 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import orjson
import pybase64
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from rollout_bridge import parse_generate_response, parse_scoring_response  # noqa: E402
from rollout_bridge.core.decode import gc_paused  # noqa: E402


def make_bodies(t: int, k: int, vocab: int = 151936, prompt_len: int = 512, seed: int = 0):
    """(nested K body, K=0 generation body, flat-b64 scoring body) for one response."""
    rng = np.random.default_rng(seed)
    ids_tk = np.stack([rng.choice(vocab, k, replace=False) for _ in range(t)])
    raw = -np.sort(rng.exponential(2.0, (t, k)), axis=1)
    raw[:, 0] = -rng.exponential(0.05, t)
    raw = -np.sort(-raw, axis=1)  # SGLang's top-K comes sorted (torch.topk)
    lp_tk = raw - np.log(np.exp(raw).sum(1, keepdims=True) + 0.01)
    pick = rng.integers(0, k + 3, t)
    sampled = np.where(pick < k, ids_tk[np.arange(t), np.minimum(pick, k - 1)],
                       rng.integers(0, vocab, t))
    sampled_lp = np.where(pick < k, lp_tk[np.arange(t), np.minimum(pick, k - 1)], -9.0)
    otl = [[float(a), int(b), None] for a, b in zip(sampled_lp, sampled)]
    meta = {"id": "bench", "finish_reason": {"type": "length", "length": t},
            "prompt_tokens": prompt_len, "completion_tokens": t, "cached_tokens": 0,
            "weight_version": "1", "e2e_latency": 1.0, "output_token_logprobs": otl}
    top = [[[float(a), int(b), None] for a, b in zip(lr, ir)]
           for lr, ir in zip(lp_tk.tolist(), ids_tk.tolist())]
    nested = orjson.dumps({"text": "", "output_ids": sampled.tolist(),
                           "meta_info": {**meta, "output_top_logprobs": top}})
    gen0 = orjson.dumps({"text": "", "output_ids": sampled.tolist(), "meta_info": meta})
    smeta = {**meta, "completion_tokens": 0, "output_token_logprobs": [],
             "input_token_logprobs": otl,
             "input_top_logprobs_val_flat_b64": pybase64.b64encode(
                 lp_tk.astype("<f4").tobytes()).decode(),
             "input_top_logprobs_idx_flat_b64": pybase64.b64encode(
                 ids_tk.astype("<i4").tobytes()).decode(),
             "input_top_logprobs_val_flat_b64_dtype": "float32",
             "input_top_logprobs_idx_flat_b64_dtype": "int32",
             "input_top_logprobs_shape": [t, k], "input_top_logprobs_null_prefix": 1}
    scoring = orjson.dumps({"text": "", "output_ids": [], "meta_info": smeta})
    fmeta = {**meta,
             "output_top_logprobs_val_flat_b64": smeta["input_top_logprobs_val_flat_b64"],
             "output_top_logprobs_idx_flat_b64": smeta["input_top_logprobs_idx_flat_b64"],
             "output_top_logprobs_val_flat_b64_dtype": "float32",
             "output_top_logprobs_idx_flat_b64_dtype": "int32",
             "output_top_logprobs_shape": [t, k], "output_top_logprobs_null_prefix": 0}
    flat_out = orjson.dumps({"text": "", "output_ids": sampled.tolist(), "meta_info": fmeta})
    return nested, gen0, scoring, flat_out


def baseline(body: bytes, k: int):
    """stdlib json + Python loops, as the DPPO reference (Stable-RL async_sglang_server) does."""
    meta = json.loads(body)["meta_info"]
    ids, lps, sampled_ids, sampled_lps = [], [], [], []
    for (slp, sid, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        top = sorted(top, key=lambda e: -e[0])[:k]
        row_ids = [e[1] for e in top]
        row_lp = [e[0] for e in top]
        if sid not in row_ids:
            row_ids[-1], row_lp[-1] = sid, slp
        ids.append(row_ids)
        lps.append(row_lp)
        sampled_ids.append(sid)
        sampled_lps.append(slp)
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(lps, dtype=torch.float32),
            torch.tensor(sampled_ids), torch.tensor(sampled_lps))


def round_robin_ms(fns: list, repeats: int) -> list[list[float]]:
    """Times every fn once per round, `repeats` rounds (after one warm-up call each): the rows of
    one round run back to back, so a change of machine load shifts all of them alike and the
    ratios between rows stay meaningful on a shared machine."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    t, k = args.tokens, args.k
    nested, gen0, scoring, flat_out = make_bodies(t, k)
    prompt = list(range(512))

    def ours_b64():
        # as SGLangEngine does: the folded support is validated once, by the scoring parse
        (s,) = parse_generate_response(gen0, top_logprobs=0, vocab_size=151936, validate=False)
        s.prompt_ids = torch.as_tensor(prompt)
        return parse_scoring_response(scoring, [s], k, 151936)

    # Both paths must agree on the support before timing anything.
    a = parse_generate_response(nested, top_logprobs=k, vocab_size=151936)[0]
    b = ours_b64()[0]
    assert torch.equal(a.support_ids, b.support_ids) and torch.equal(a.support_valid,
                                                                     b.support_valid)
    c = parse_generate_response(flat_out, top_logprobs=k, vocab_size=151936)[0]
    assert all(torch.equal(getattr(a, n), getattr(c, n))
               for n in ("support_ids", "support_logprobs", "support_valid"))
    def floor_paused():
        with gc_paused():
            return orjson.loads(nested)

    rows = [
        ("floor: one orjson.loads (nested body), GC paused", floor_paused, len(nested)),
        ("one orjson.loads with the GC running (for reference)", lambda: orjson.loads(nested),
         len(nested)),
        ("ours, JSON path (parse_generate_response)",
         lambda: parse_generate_response(nested, top_logprobs=k, vocab_size=151936), len(nested)),
        ("baseline: stdlib json + Python loops", lambda: baseline(nested, k), len(nested)),
        ("ours, binary: output-side flat b64 (one /generate, `flat_b64`)",
         lambda: parse_generate_response(flat_out, top_logprobs=k, vocab_size=151936),
         len(flat_out)),
        ("ours, binary: K=0 gen body + b64 scoring body (`scoring_b64`)", ours_b64,
         len(gen0) + len(scoring)),
    ]
    times = round_robin_ms([fn for _, fn, _ in rows], args.repeats)
    res = [(name, statistics.median(ts), min(ts), size)
           for (name, _, size), ts in zip(rows, times)]
    floor, base = res[0][1], res[3][1]
    print(f"T={t} tokens, K={k}, torch {torch.__version__}, numpy {np.__version__}, "
          f"orjson {orjson.__version__}, {os.cpu_count()} CPUs, {args.repeats} round-robin "
          f"rounds, load average {os.getloadavg()[0]:.1f}\n")
    floor_min = res[0][2]
    print("| path | payload MB | median ms | min ms | x floor (medians) | x floor (minima) | "
          "speedup vs baseline |")
    print("|---|---|---|---|---|---|---|")
    for name, ms, lo, size in res:
        print(f"| {name} | {size / 1e6:.2f} | {ms:.1f} | {lo:.1f} | {ms / floor:.2f} | "
              f"{lo / floor_min:.2f} | {base / ms:.1f}x |")


if __name__ == "__main__":
    main()
