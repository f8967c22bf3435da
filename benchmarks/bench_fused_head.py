"""Benchmark: the fused LM head + token statistics vs linear + loss (fwd + bwd to hidden, weight).

Variants, on rank 0's shard (hidden [N, H], weight shard [V_local, H]) in one process:
  linear_ce   logits = hidden @ weight.T, megatron's vocab_parallel_cross_entropy
  linear_op   logits = hidden @ weight.T, token_stats(..., inplace=True) (the adapter's path)
  fused       fused_token_stats(hidden, weight, ...) (logits never materialised)
Each step takes torch.autograd.grad(loss, [hidden, weight]).

Inputs: the support, sampled tokens and behaviour log-probs are benchmarks/bench_inputs.py's
`realistic` rows for a vocabulary of V_local * tp; hidden and weight are Gaussian with the
logits' scale ~3 (hidden @ weight.T is not those rows' logits: the fused op's cost does not
depend on where the row maximum lies, the support only decides which columns each chunk masks).

Timing: medians over --reps rounds after a warm-up, variants alternating within each round;
wall time and process CPU time (the steadier one for a 1-thread run on a shared machine).
Peak memory (--memory): each variant once in a fresh spawned process; extra peak RSS over the
inputs (bench_op.py's VmHWM reset), which includes the gradients [N, H] and [V_local, H].
--sweep-chunks times the fused op alone for a few chunk shapes (how the defaults were chosen).

Usage:
  python benchmarks/bench_fused_head.py --tokens 2048 --hidden 576 --vocab-local 16384 \
      --threads 1 --reps 3 --memory
  python benchmarks/bench_fused_head.py --tokens 2048 --hidden 576 --vocab-local 16384 \
      --threads 1 --sweep-chunks 256x4096,1024x2048
"""

from __future__ import annotations

import bench_op  # noqa: F401  (first: sets OMP_NUM_THREADS from --threads before torch loads)

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inputs import make_inputs
from bench_op import _peak_rss, _reset_peak, _rss, _setup_megatron_ce

VARIANTS = ("linear_ce", "linear_op", "fused")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_head_inputs(n: int, h: int, vl: int, tp: int, k: int, dtype, seed: int = 0) -> dict:
    """hidden [N, H], weight [Vl, H] (logit scale ~3) and the realistic support of rank 0."""
    sup = make_inputs("realistic", n, vl, tp, k, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(vl, h, generator=g) * (3.0 / h ** 0.5)).to(dtype)
    return {"hidden": hidden, "weight": weight, "sampled": sup["sampled"], "ids": sup["ids"],
            "logprobs": sup["logprobs"], "valid": sup["valid"], "vocab": sup["vocab_size"]}


def step_fn(variant: str, inp: dict, token_chunk: int, vocab_chunk: int):
    """step(h, w) -> (grad_h, grad_w)."""
    import megatron_pdm as pdm
    from megatron_pdm.parallel.fused_head import fused_token_stats

    sampled, ids, lp, valid = (inp[k] for k in ("sampled", "ids", "logprobs", "valid"))
    vl = inp["weight"].shape[0]
    # rank 0 alone: ids >= V_local belong to other ranks (not owned here), as on a real group
    if variant == "linear_ce":
        ce = _setup_megatron_ce()
        local = sampled.clamp(max=vl - 1)

        def loss(h, w):
            return ce(h @ w.t(), local).sum()
    elif variant == "linear_op":
        def loss(h, w):
            return pdm.token_stats(h @ w.t(), sampled, ids, lp, valid, tp_group=None,
                                   vocab_size=vl, validate=False, inplace=True).logprob.sum()
    elif variant == "fused":
        def loss(h, w):
            return fused_token_stats(h, w, sampled, ids, lp, valid, tp_group=None,
                                     vocab_size=vl, validate=False, token_chunk=token_chunk,
                                     vocab_chunk=vocab_chunk).logprob.sum()
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")

    def step(h, w):
        return torch.autograd.grad(loss(h, w), [h, w])

    return step


def _leaves(inp):
    return (inp["hidden"].clone().requires_grad_(), inp["weight"].clone().requires_grad_())


def _peak_memory(_, variant, path, threads, chunks, queue):
    if threads:
        torch.set_num_threads(threads)
    inp = torch.load(path)
    step = step_fn(variant, inp, *chunks)
    h, w = _leaves(inp)
    base = _rss()
    if not _reset_peak():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
    grads = step(h, w)
    peak = _peak_rss()
    del grads
    queue.put((variant, max(0, peak - base)))


def timings(variants, inp, reps, chunks) -> dict[str, tuple[float, float]]:
    """Median (wall s, process CPU s) per variant. On a shared machine the CPU time of a
    1-thread run is the steadier number (other jobs stretch wall time, not CPU time)."""
    steps = {v: step_fn(v, inp, *chunks) for v in variants}
    times = {v: [] for v in variants}
    for round_ in range(reps + 1):
        for v, step in steps.items():
            h, w = _leaves(inp)
            t0, c0 = time.perf_counter(), time.process_time()
            grads = step(h, w)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if round_:
                times[v].append((dt, dc))
            del grads
    return {v: (statistics.median(a for a, _ in t), statistics.median(b for _, b in t))
            for v, t in times.items()}


def peak_memory(variants, inp, threads, chunks) -> dict[str, float]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "inputs.pt")
        torch.save(inp, path)
        queue = mp.get_context("spawn").Queue()
        for v in variants:
            mp.start_processes(_peak_memory, args=(v, path, threads, chunks, queue), nprocs=1,
                               join=True, start_method="spawn")
            name, mem = queue.get()
            out[name] = mem / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab-local", type=int, default=16384)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--token-chunk", type=int, default=None)
    ap.add_argument("--vocab-chunk", type=int, default=None)
    ap.add_argument("--memory", action="store_true", help="also the peak-RSS processes")
    ap.add_argument("--no-time", action="store_true", help="memory only")
    ap.add_argument("--sweep-chunks", default=None,
                    help="time the fused op alone for chunk shapes, e.g. 256x4096,1024x2048")
    args = ap.parse_args()
    from megatron_pdm.parallel.fused_head import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK

    if args.threads:
        torch.set_num_threads(args.threads)
    chunks = (args.token_chunk or DEFAULT_TOKEN_CHUNK, args.vocab_chunk or DEFAULT_VOCAB_CHUNK)
    inp = make_head_inputs(args.tokens, args.hidden, args.vocab_local, args.tp, args.top_k,
                           DTYPES[args.dtype])
    grads_mib = ((args.tokens + args.vocab_local) * args.hidden * inp["hidden"].element_size()
                 / 2**20)
    print(f"N={args.tokens} H={args.hidden} V_local={args.vocab_local} K={args.top_k} "
          f"dtype={args.dtype} threads={torch.get_num_threads()} reps={args.reps} "
          f"chunks={chunks} load={os.getloadavg()[0]:.2f} gradients (every variant returns them) "
          f"{grads_mib:.0f} MiB", flush=True)
    if args.sweep_chunks:
        for shape in args.sweep_chunks.split(","):
            tc, vc = (int(x) for x in shape.split("x"))
            wall, cpu = timings(["fused"], inp, args.reps, (tc, vc))["fused"]
            print(f"| {tc} x {vc} | {wall:.3f} | {cpu:.3f} |", flush=True)
        return
    variants = args.variants.split(",")
    med = {} if args.no_time else timings(variants, inp, args.reps, chunks)
    mem = peak_memory(variants, inp, args.threads, chunks) if args.memory else {}
    nan = (float("nan"), float("nan"))
    print("| variant | wall median (s) | CPU median (s) | CPU vs linear_ce | extra peak RSS (MiB) "
          "| vs linear_ce |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        (wall, cpu), ce_cpu = med.get(v, nan), med.get("linear_ce", nan)[1]
        m = mem.get(v, float("nan"))
        print(f"| {v} | {wall:.3f} | {cpu:.3f} | {cpu / ce_cpu:.2f}x | {m:.0f} | "
              f"{m / mem.get('linear_ce', float('nan')):.2f}x |", flush=True)
    print(f"<!-- load at end {os.getloadavg()[0]:.2f} -->")


if __name__ == "__main__":
    main()
