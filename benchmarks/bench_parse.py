"""Benchmark: SGLang top-K responses (K=20, 8k tokens) -> rollout samples.

Compares, in one run on the same synthetic but realistically shaped bodies (the SGLang
response shapes of docs/engines.md):
  floor     one orjson.loads of the nested /generate body with the cyclic GC paused (any JSON
            path pays this); also shown with the GC running
  ours-json rollout_bridge.parse_generate_response (orjson + C-level flattening + numpy)
  previous  the same function as it was at git revision --previous (default PREVIOUS_REV, the
            parser before the one-flatten change), loaded from `git show REV:path` into
            private module names at run time: the exact committed code, not an editable copy
  baseline  stdlib json + per-position Python loops + torch.tensor (the DPPO/Stable-RL way)
  ours-flat binary path, one request: the /generate body with the output top-K as SGLang's
            flat base64 arrays (`return_flat_raw_output_top_logprobs`), parse_generate_response
  ours-b64  binary path, two requests: generation body with K=0 + scoring body with flat base64
            prompt-side top-K (parse_generate_response + parse_scoring_response)
Rows are timed round-robin (every row once per round), so their ratios hold on a loaded machine;
reports medians, minima and ratios (wall clock and the process's CPU time, which a loaded
machine disturbs less). Usage: python benchmarks/bench_parse.py [--tokens 8192 --k 20]
[--previous REV] [--out results/parse/NAME] (writes NAME.json and NAME.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

import numpy as np
import orjson
import pybase64
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from rollout_bridge import parse_generate_response, parse_scoring_response  # noqa: E402
from rollout_bridge.core.decode import gc_paused  # noqa: E402
from megatron_pdm.hostinfo import cpu_model  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PREVIOUS_REV = "83ae521"  # main before the nested path flattened each position once


def load_previous(rev: str):
    """`parse_generate_response` of git revision `rev`: its sglang/parse.py and core/decode.py
    (the two files the nested path runs through) exec'd as private modules, the parser's import of
    decode pointed at the old decode; every other import is today's (unchanged modules)."""
    def source(path: str) -> str:
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True,
                              capture_output=True, text=True).stdout

    def module(name: str, text: str):
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        exec(compile(text, f"{rev}:{name}", "exec"), mod.__dict__)
        return mod

    module("_previous_decode", source("rollout_bridge/core/decode.py"))
    parse_src = source("rollout_bridge/sglang/parse.py")
    assert parse_src.count("from rollout_bridge.core.decode import") == 1
    parse_src = parse_src.replace("from rollout_bridge.core.decode import",
                                  "from _previous_decode import")
    return module("_previous_parse", parse_src).parse_generate_response


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


def round_robin_ms(fns: list, repeats: int
                  ) -> tuple[list[list[float]], list[list[float]]]:
    """Times every fn once per round, `repeats` rounds (after one warm-up call each): the rows of
    one round run back to back, so a change of machine load shifts all of them alike and the
    ratios between rows stay meaningful on a shared machine. Returns (wall ms, CPU ms) per row."""
    for fn in fns:
        fn()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, w, c in zip(fns, wall, cpu):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            c.append((time.process_time() - start_cpu) * 1e3)
            w.append((time.perf_counter() - start) * 1e3)
    return wall, cpu


def _head() -> str:
    """The checkout's commit (+ "-dirty" with uncommitted changes), for the results record."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True).stdout
    return git("rev-parse", "--short", "HEAD").strip() + ("-dirty" if git(
        "status", "--porcelain", "--untracked-files=no").strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--previous", default=PREVIOUS_REV,
                    help="git revision whose parser is timed beside today's ('' to skip)")
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    t, k = args.tokens, args.k
    nested, gen0, scoring, flat_out = make_bodies(t, k)
    prompt = list(range(512))

    def ours_b64():
        # as SGLangEngine does: the folded support is validated once, by the scoring parse
        (s,) = parse_generate_response(gen0, top_logprobs=0, vocab_size=151936, validate=False)
        s.prompt_ids = torch.as_tensor(prompt)
        return parse_scoring_response(scoring, [s], k, 151936)

    # Both paths (and the previous parser) must agree on the support before timing anything.
    fields = ("response_ids", "behavior_logprob", "support_ids", "support_logprobs",
              "support_valid")
    a = parse_generate_response(nested, top_logprobs=k, vocab_size=151936)[0]
    b = ours_b64()[0]
    assert torch.equal(a.support_ids, b.support_ids) and torch.equal(a.support_valid,
                                                                     b.support_valid)
    c = parse_generate_response(flat_out, top_logprobs=k, vocab_size=151936)[0]
    assert all(torch.equal(getattr(a, n), getattr(c, n))
               for n in ("support_ids", "support_logprobs", "support_valid"))
    previous = load_previous(args.previous) if args.previous else None
    if previous is not None:
        p = previous(nested, top_logprobs=k, vocab_size=151936)[0]
        assert all(torch.equal(getattr(a, n), getattr(p, n)) for n in fields)
        assert a.meta_info == p.meta_info

    def floor_paused():
        with gc_paused():
            return orjson.loads(nested)

    rows = [
        ("floor: one orjson.loads (nested body), GC paused", floor_paused, len(nested)),
        ("one orjson.loads with the GC running (for reference)", lambda: orjson.loads(nested),
         len(nested)),
        ("ours, JSON path (parse_generate_response)",
         lambda: parse_generate_response(nested, top_logprobs=k, vocab_size=151936), len(nested)),
    ]
    if previous is not None:
        rows.append((f"previous, JSON path (parse_generate_response at {args.previous})",
                     lambda: previous(nested, top_logprobs=k, vocab_size=151936), len(nested)))
    rows += [
        ("baseline: stdlib json + Python loops", lambda: baseline(nested, k), len(nested)),
        ("ours, binary: output-side flat b64 (one /generate, `flat_b64`)",
         lambda: parse_generate_response(flat_out, top_logprobs=k, vocab_size=151936),
         len(flat_out)),
        ("ours, binary: K=0 gen body + b64 scoring body (`scoring_b64`)", ours_b64,
         len(gen0) + len(scoring)),
    ]
    load_before = os.getloadavg()
    wall, cpu = round_robin_ms([fn for _, fn, _ in rows], args.repeats)
    load_after = os.getloadavg()
    names = [name for name, _, _ in rows]
    floor_i, base_i = 0, names.index("baseline: stdlib json + Python loops")
    ours_i = 2
    prev_i = 3 if previous is not None else None
    res = []
    for i, (name, _, size) in enumerate(rows):
        r = {"path": name, "payload_mb": round(size / 1e6, 3),
             "median_ms": statistics.median(wall[i]), "min_ms": min(wall[i]),
             "cpu_median_ms": statistics.median(cpu[i]), "cpu_min_ms": min(cpu[i]),
             "x_floor_median": statistics.median(wall[i]) / statistics.median(wall[floor_i]),
             "x_floor_cpu_median": statistics.median(cpu[i]) / statistics.median(cpu[floor_i]),
             "speedup_vs_baseline": statistics.median(wall[base_i]) / statistics.median(wall[i])}
        res.append(r)
    ratio = None
    if prev_i is not None:
        # per-round ratios of the two JSON parsers (same round: same machine state)
        per_round = [o / p for o, p in zip(wall[ours_i], wall[prev_i])]
        per_round_cpu = [o / p for o, p in zip(cpu[ours_i], cpu[prev_i])]
        ratio = {"new_over_previous_median_of_round_ratios": statistics.median(per_round),
                 "new_over_previous_cpu_median_of_round_ratios":
                     statistics.median(per_round_cpu),
                 "new_over_previous_minima": min(wall[ours_i]) / min(wall[prev_i]),
                 "new_over_previous_cpu_minima": min(cpu[ours_i]) / min(cpu[prev_i]),
                 "rounds_new_faster": sum(r < 1 for r in per_round_cpu)}
    head = (f"T={t} tokens, K={k}, torch {torch.__version__}, numpy {np.__version__}, "
            f"orjson {orjson.__version__}, {cpu_model()}, {os.cpu_count()} CPUs, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {args.repeats} "
            f"round-robin rounds, load average {load_before[0]:.1f} before / "
            f"{load_after[0]:.1f} after")
    lines = [head, "",
             "| path | payload MB | median ms | min ms | CPU median ms | x floor (medians) | "
             "x floor (CPU medians) | speedup vs baseline |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res:
        lines.append(f"| {r['path']} | {r['payload_mb']:.2f} | {r['median_ms']:.1f} | "
                     f"{r['min_ms']:.1f} | {r['cpu_median_ms']:.1f} | "
                     f"{r['x_floor_median']:.2f} | {r['x_floor_cpu_median']:.2f} | "
                     f"{r['speedup_vs_baseline']:.1f}x |")
    if ratio is not None:
        lines += ["", f"new / previous ({args.previous}), JSON path: median of per-round ratios "
                  f"{ratio['new_over_previous_median_of_round_ratios']:.3f} wall, "
                  f"{ratio['new_over_previous_cpu_median_of_round_ratios']:.3f} CPU; minima "
                  f"{ratio['new_over_previous_minima']:.3f} wall, "
                  f"{ratio['new_over_previous_cpu_minima']:.3f} CPU; new faster (CPU) in "
                  f"{ratio['rounds_new_faster']} of {args.repeats} rounds"]
    print("\n".join(lines))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                  "tokens": t, "k": k, "repeats": args.repeats, "seed": 0,
                  "previous_rev": args.previous, "head": _head(), "cpu_model": cpu_model(),
                  "cpu_count": os.cpu_count(),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                  "load_average_before": load_before, "load_average_after": load_after,
                  "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "rows": res, "new_over_previous": ratio,
                  "wall_ms": wall, "cpu_ms": cpu}
        with open(args.out + ".json", "w") as f:
            json.dump(record, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
