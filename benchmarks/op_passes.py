"""Where the time of CE and of the op goes on one shard: the passes, timed one by one.

Part 1 times the single passes both use on an [N, V_local] shard (medians of --reps): the bf16 ->
fp32 upcast into a fresh tensor (CE's `.float()`: page faults on every new page) and into a
reused row-chunk buffer (the op), the fp32 -> bf16 cast of the gradient, exp, max with indices
(CE) and amax on bf16 (the op), sum, sum of squares, a row scaling, and a mixed-dtype row scaling.
Part 2 runs torch.profiler over one forward + backward of CE and of the op (default chunks and
64 MiB chunks) and lists the aten ops by self CPU time with their call counts: each call is one
parallel region on a multi-threaded CPU (a barrier every thread must reach).

    python benchmarks/op_passes.py --tokens 2048 --vocab-local 16384 --threads 1
"""

from __future__ import annotations

import bench_op  # noqa: F401  (first: sets OMP_NUM_THREADS from --threads before torch loads)

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inputs import make_inputs

import megatron_pdm as pdm


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def passes(n: int, v: int, reps: int) -> list[tuple[str, float]]:
    g = torch.Generator().manual_seed(0)
    x_NV = (2 * torch.randn(n, v, generator=g)).bfloat16()
    f_NV = x_NV.float()
    out_NV = torch.empty_like(f_NV)
    rows = max(1, (1 << 20) // v)
    buf_RV = torch.empty(rows, v)
    shift_N = torch.randn(n)
    grad_NV = torch.empty_like(x_NV)

    def chunked_upcast():
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            buf_RV[: r1 - r0].copy_(x_NV[r0:r1])

    return [
        ("bf16 -> fp32 into a fresh tensor (CE's .float())", _median_ms(lambda: x_NV.float(), reps)),
        ("bf16 -> fp32 into a reused 2^20-element row buffer, all rows",
         _median_ms(chunked_upcast, reps)),
        ("fp32 -> bf16 into a fresh tensor (a gradient's cast)",
         _median_ms(lambda: f_NV.to(torch.bfloat16), reps)),
        ("fp32 -> bf16 into an allocated tensor", _median_ms(lambda: grad_NV.copy_(f_NV), reps)),
        ("exp fp32 (out=)", _median_ms(lambda: torch.exp(f_NV, out=out_NV), reps)),
        ("max with indices, fp32 (CE)", _median_ms(lambda: f_NV.max(-1), reps)),
        ("amax, bf16 (the op)", _median_ms(lambda: x_NV.amax(-1), reps)),
        ("sum fp32", _median_ms(lambda: f_NV.sum(-1), reps)),
        ("sum of squares fp32 (vector_norm)",
         _median_ms(lambda: torch.linalg.vector_norm(f_NV, 2, -1), reps)),
        ("row scaling fp32 (mul_)", _median_ms(lambda: out_NV.mul_(shift_N[:, None]), reps)),
        ("row scaling bf16 by an fp32 factor (mixed dtypes)",
         _median_ms(lambda: grad_NV.mul_(shift_N[:, None]), reps)),
    ]


def profiles(n: int, v: int, dtype: torch.dtype) -> dict[str, list[tuple[str, int, float]]]:
    inp = make_inputs("realistic", n, v, 2, 20, dtype, seed=0)
    ce = bench_op._step_fn("ce", inp)
    sampled, ids, lp, valid = inp["sampled"], inp["ids"], inp["logprobs"], inp["valid"]

    def op(chunk):
        def step(x):
            stats = pdm.token_stats(x, sampled, ids, lp, valid, vocab_size=v, validate=False,
                                    inplace=True, tp_group=None, chunk_elems=chunk)
            return torch.autograd.grad(stats.logprob.sum(), x)[0]
        return step

    w = torch.ones((), dtype=dtype, requires_grad=True)
    out = {}
    for name, step in (("ce", ce), ("op_inplace (default chunks)", op(None)),
                       ("op_inplace (2^24-element chunks)", op(1 << 24))):
        step(inp["shard"] * w)  # warm-up
        x = inp["shard"] * w
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(x)
        rows = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
                if e.key.startswith("aten::")]
        out[name] = sorted(rows, key=lambda r: -r[2])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab-local", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n, v = args.tokens, args.vocab_local
    print(f"N {n} x V_local {v}, threads {torch.get_num_threads()}\n")
    print("| pass over the shard | ms |\n|---|---|")
    for name, ms in passes(n, v, args.reps):
        print(f"| {name} | {ms:.1f} |")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for name, rows in profiles(n, v, dtype).items():
        calls = sum(r[1] for r in rows)
        total = sum(r[2] for r in rows)
        print(f"\n{name} ({args.dtype}): {calls} aten calls, {total:.0f} ms self CPU\n")
        print("| aten op | calls | self CPU ms |\n|---|---|---|")
        for key, count, ms in rows[:8]:
            print(f"| {key} | {count} | {ms:.1f} |")


if __name__ == "__main__":
    main()
