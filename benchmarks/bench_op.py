"""Benchmark: the fused token-stats op vs Megatron's vocab-parallel cross-entropy (fwd + bwd).

What is compared, on the same [N, V/TP] logits shard, in one invocation:
  ce      megatron.core.tensor_parallel.vocab_parallel_cross_entropy, fwd + bwd
  op      megatron_pdm.token_stats (support S = K + 1 = 21) + backward of sum(g * logprob)
  op_inplace  the same with inplace=True (fp32: exp kept in the logits storage for backward,
          as Megatron's CE does; bf16 ignores the flag)
  gather  "gather then log_softmax": concatenate the TP shards into full [N, V] logits (what an
          all-gather produces), fp32 log_softmax, gather the sampled ids, fwd + bwd

TP = 2 is simulated on CPU with ONE process holding one shard of width V/2 and a size-1 group:
the per-rank work of every variant is its passes over the [N, V/2] shard, which this measures
exactly; the collectives (2 small all-reduces of [N, 2] and [N, S+6] for the op, 3 of [N] for
CE) are tiny next to that and are not simulated (Megatron's CE runs its all-reduces on a real
world-1 gloo group; our op skips them for size 1). The gather baseline materializes the full
vocabulary exactly as TP = 2 would after an all-gather.

Peak memory: each variant runs in a fresh spawned process; we read the RSS after the inputs are
allocated and the process's high-water mark (resource.getrusage ru_maxrss) after one fwd+bwd, and
report the difference ("extra peak" over the inputs). tracemalloc does not see torch's allocator,
and the CPU caching allocator never shrinks ru_maxrss, so the first iteration gives the peak.
Times are medians over --reps rounds after one warm-up round, measured in one process where the
variants alternate within each round (so load from other jobs on a shared box hits all alike);
inputs are re-cloned outside the timed region (Megatron's CE overwrites fp32 logits in place).
The logits are a leaf tensor here, so autograd's AccumulateGrad copies any gradient that aliases
them (CE's, and op_inplace's); inside Megatron the logits are not a leaf and that copy vanishes.

Usage:
  python benchmarks/bench_op.py                      # N=4096, V=151936, TP=2, fp32 (minutes)
  python benchmarks/bench_op.py --tokens 512 --reps 3 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import psutil
import torch
import torch.multiprocessing as mp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(n, vocab, tp, k, dtype):
    g = torch.Generator().manual_seed(0)
    vl = vocab // tp
    shard = (torch.randn(n, vl, generator=g) * 3).to(dtype)
    other = (torch.randn(n, vl, generator=g) * 3).to(dtype)
    top = torch.stack([torch.randperm(vl, generator=g)[:k] for _ in range(min(n, 64))])
    top = top.repeat((n + 63) // 64, 1)[:n]
    sampled = top[:, 0].clone()
    ids = torch.cat([top, torch.zeros(n, 1, dtype=torch.long)], 1).to(torch.int32)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[:, -1] = False  # sampled token inside the top-K
    logprobs = torch.full(ids.shape, -4.0)
    return shard, other, sampled, ids, logprobs, valid


def _setup_megatron_ce():
    import torch.distributed as dist
    from megatron.core.tensor_parallel import cross_entropy as ce_mod

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    # World-1 TP group without initializing all of Megatron's parallel state.
    ce_mod.get_tensor_model_parallel_group = lambda *a, **kw: dist.group.WORLD
    ce_mod.get_tensor_model_parallel_rank = lambda *a, **kw: 0
    ce_mod.get_tensor_model_parallel_world_size = lambda *a, **kw: 1
    return ce_mod.vocab_parallel_cross_entropy


def _step_fn(variant, shard, other, sampled, ids, logprobs, valid):
    import megatron_pdm as pdm

    if variant == "ce":
        ce = _setup_megatron_ce()

        def step(x):
            loss = ce(x, sampled)
            loss.sum().backward()

        return step
    if variant in ("op", "op_inplace"):
        inplace = variant == "op_inplace"

        def step(x):
            stats = pdm.token_stats(x, sampled, ids, logprobs, valid, vocab_size=x.shape[1],
                                    inplace=inplace)
            stats.logprob.sum().backward()

        return step

    def step(x):
        full = torch.cat([x, other], dim=1)  # what an all-gather of the TP shards produces
        logp = torch.log_softmax(full.float(), dim=-1)
        logp.gather(1, sampled[:, None]).sum().backward()

    return step


def _peak_memory(_, variant, n, vocab, tp, k, dtype_name, queue):
    """Fresh process: extra RSS high-water of one fwd+bwd over the allocated inputs."""
    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    shard, other, sampled, ids, logprobs, valid = _inputs(n, vocab, tp, k, DTYPES[dtype_name])
    step = _step_fn(variant, shard, other, sampled, ids, logprobs, valid)
    x = shard.clone().requires_grad_()
    base_rss = psutil.Process().memory_info().rss
    step(x)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((variant, max(0, peak - base_rss)))


def _timings(variants, n, vocab, tp, k, dtype_name, reps) -> dict[str, float]:
    """Medians over `reps` rounds; variants alternate within a round, so background load on a
    shared machine affects all of them alike."""
    shard, other, sampled, ids, logprobs, valid = _inputs(n, vocab, tp, k, DTYPES[dtype_name])
    steps = {v: _step_fn(v, shard, other, sampled, ids, logprobs, valid) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(reps + 1):  # round 0 is the warm-up
        for v, step in steps.items():
            x = shard.clone().requires_grad_()
            t0 = time.perf_counter()
            step(x)
            if round_:
                times[v].append(time.perf_counter() - t0)
            del x
    return {v: statistics.median(t) for v, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="ce,op,op_inplace,gather")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["BENCH_THREADS"] = str(args.threads)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    variants = args.variants.split(",")
    memory = {}
    for variant in variants:
        mp.start_processes(
            _peak_memory,
            args=(variant, args.tokens, args.vocab, args.tp, args.top_k, args.dtype, queue),
            nprocs=1, join=True, start_method="spawn",
        )
        name, mem = queue.get()
        memory[name] = mem
    medians = _timings(variants, args.tokens, args.vocab, args.tp, args.top_k, args.dtype,
                       args.reps)
    results = {v: (medians[v], memory[v]) for v in variants}
    print(f"N={args.tokens} V={args.vocab} TP={args.tp} (shard {args.vocab // args.tp}) "
          f"K={args.top_k} dtype={args.dtype} threads={torch.get_num_threads()} reps={args.reps}")
    print("| variant | fwd+bwd median (s) | vs CE | extra peak RSS (MiB) | vs CE |")
    print("|---|---|---|---|---|")
    t_ce, m_ce = results.get("ce", (float("nan"), float("nan")))
    for name, (t, mem) in results.items():
        print(f"| {name} | {t:.3f} | {t / t_ce:.2f}x | {mem / 2**20:.0f} | "
              f"{(mem / m_ce if m_ce else float('nan')):.2f}x |")


if __name__ == "__main__":
    main()
