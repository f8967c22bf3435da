"""Benchmark: the fused token-stats op vs Megatron's vocab-parallel cross-entropy (fwd + bwd).

What is compared, on the same [N, V_local] logits shard of one TP rank, in one process:
  ce          megatron.core.tensor_parallel.vocab_parallel_cross_entropy, fwd + bwd
  op_inplace  megatron_pdm.token_stats(..., inplace=True, validate=False): the Megatron adapter's
              path (fp32: works in the logits' storage like CE; bf16 ignores the flag)
  op_inplace_wide  op_inplace with 2^24-element row chunks (`chunk_elems`; the default before
              2026-12-06 on every device, kept for a paired before/after on a one-thread CPU)
  op          token_stats with the logits kept intact (default; softmax recomputed in backward)
  op_inplace_validated  op_inplace with validate=True (the support contract checked on the host
              every call, as for a caller that did not validate at the bridge)
  gather      "all-gather then log_softmax": full [N, V] logits, fp32 log_softmax, fwd + bwd
  ce_fp32     Megatron's default loss path on 16-bit logits: CE of `logits.float()`
  op_fp32     16-bit logits cast to fp32 (what an fp32 LM-head output costs) then op_inplace;
              with --dtype bf16, op / op_inplace are the op's own bf16 path (no copy)

Inputs (benchmarks/bench_inputs.py): `realistic` = what RL feeds the op (support = top-K of a
behaviour distribution near the policy, sampled tokens drawn from the policy, behaviour
log-probs from that distribution), `random` = the earlier random-support inputs, `real` = the
real model's logits (SmolLM2-135M-Instruct, V = 49,152: `--real` sets N 2048, V_local 16384 at
TP 3; give --tp 1 for the whole vocabulary). V_local defaults to one TP rank's shard of
megatron's padded vocabulary (`megatron_pdm.arch.vocab_shard_width`). The logits are
a non-leaf (`base * w` with a scalar leaf w, made outside the timed region), as inside Megatron,
and the gradient is taken with torch.autograd.grad(loss, logits): no AccumulateGrad copy for
any variant. Loss = sum of the per-token CE (resp. sum of log pi_k), gradient of ones.

One process holds rank 0's shard with a size-1 group: the per-rank work of every variant is its
passes over the [N, V_local] shard, which this measures exactly; the collectives (the op's
[N, 1] MAX and [N, S+3] SUM, CE's three [N] all-reduces) are tiny next to that and are not
simulated (CE runs its all-reduces on a real world-1 gloo group; our op skips them for size 1).

Timing: medians over --reps rounds after one warm-up round; the variants alternate within every
round (load from other jobs on a shared machine hits all of them alike); fresh logits are made
outside the timed region before every step (CE and op_inplace overwrite them). Also reported:
the fastest round (`min_s`) and the paired ratio (`vs_ce_paired`, the median over rounds of the
variant's time over CE's in the same round), steadier than the ratio of medians when other jobs
load the machine; the same for the process CPU time of each step (`cpu_times_s`,
`vs_ce_paired_cpu`: time spent waiting for a core on a busy machine is not in it). Threads:
`--threads n` sets OMP_NUM_THREADS and torch.set_num_threads(n) before torch starts.
Peak memory: each variant runs once in a fresh spawned process that loads the same inputs; the
peak RSS (VmHWM, reset through /proc/self/clear_refs once the inputs and the logits exist) minus
the RSS at that point is the "extra peak" a variant needs over its inputs.

Usage:
  python benchmarks/bench_op.py --tokens 2048 --tp 2 --threads 1     # V_local 76032
  python benchmarks/bench_op.py --tokens 8192 --tp 4 --dtype bf16 \
      --inputs realistic,random --threads 2 --json results.jsonl
  python benchmarks/bench_op.py --real --threads 1      # real model, TP 3 shard
"""

from __future__ import annotations

import os
import sys


def _early_threads() -> None:
    """OMP_NUM_THREADS must be set before torch is imported (it sizes the OpenMP pool)."""
    for i, arg in enumerate(sys.argv):
        value = None
        if arg == "--threads" and i + 1 < len(sys.argv):
            value = sys.argv[i + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
        if value and value != "0":
            os.environ["OMP_NUM_THREADS"] = value
            os.environ["MKL_NUM_THREADS"] = value


_early_threads()

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from bench_inputs import describe, make_inputs

from megatron_pdm.arch import vocab_shard_width

V_QWEN3 = 151936  # Qwen3's vocabulary
V_REAL = 49152  # SmolLM2-135M-Instruct's (--real)
DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by default

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("ce", "op_inplace", "op_inplace_wide", "op_inplace_validated", "op", "gather",
            "ce_fp32", "op_fp32")


def _setup_megatron_ce():
    import torch.distributed as dist
    from megatron.core.tensor_parallel import cross_entropy as ce_mod

    if not dist.is_initialized():  # an in-process store: no port to collide with other jobs
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # World-1 TP group without initializing all of Megatron's parallel state.
    ce_mod.get_tensor_model_parallel_group = lambda *a, **kw: dist.group.WORLD
    ce_mod.get_tensor_model_parallel_rank = lambda *a, **kw: 0
    ce_mod.get_tensor_model_parallel_world_size = lambda *a, **kw: 1
    return ce_mod.vocab_parallel_cross_entropy


def _step_fn(variant: str, inp: dict):
    """step(x) -> gradient w.r.t. the non-leaf logits x (kept alive by the caller)."""
    import megatron_pdm as pdm

    sampled, ids, lp, valid = inp["sampled"], inp["ids"], inp["logprobs"], inp["valid"]
    if variant in ("ce", "ce_fp32"):
        ce = _setup_megatron_ce()
        cast = variant == "ce_fp32"

        def step(x):
            loss = ce(x.float() if cast else x, sampled).sum()
            return torch.autograd.grad(loss, x)[0]

        return step
    if variant == "op_fp32":
        vocab = inp["shard"].shape[1]

        def step(x):
            stats = pdm.token_stats(x.float(), sampled, ids, lp, valid, vocab_size=vocab,
                                    validate=False, inplace=True, tp_group=None)
            return torch.autograd.grad(stats.logprob.sum(), x)[0]

        return step
    if variant in ("op", "op_inplace", "op_inplace_wide", "op_inplace_validated"):
        inplace = variant != "op"
        chunk = (1 << 24) if variant == "op_inplace_wide" else None
        validate = variant == "op_inplace_validated"
        # rank 0's shard alone: ids of the other ranks' shards (>= V_local) are not owned here,
        # exactly as on rank 0 of a real group (validate=False: the adapter's setting). The
        # validated variant checks the ids against the full vocabulary (a TP rank validates
        # the replicated support against the engine's vocabulary) and so needs them in range
        # of the shard it is given: it runs with vocab_size = V_local only when every id fits.
        vocab = inp["shard"].shape[1]
        if validate and int(ids[valid].max()) >= vocab:
            raise ValueError("op_inplace_validated needs every support id < V_local (use --tp 1)")

        def step(x):
            stats = pdm.token_stats(x, sampled, ids, lp, valid, vocab_size=vocab,
                                    validate=validate, inplace=inplace, tp_group=None,
                                    chunk_elems=chunk)
            return torch.autograd.grad(stats.logprob.sum(), x)[0]

        return step
    if variant == "gather":
        other = inp["other"]

        def step(x):
            full = torch.cat([x, other], dim=1)  # what an all-gather of the TP shards produces
            logp = torch.log_softmax(full.float(), dim=-1)
            return torch.autograd.grad(logp.gather(1, sampled[:, None]).sum(), x)[0]

        return step
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def _fresh_logits(base: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return base * w  # a non-leaf [N, Vl] tensor with the values of `base`


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_memory(_, variant: str, path: str, threads: int, queue) -> None:
    """Fresh process: extra peak RSS of one fwd+bwd over the inputs and the logits."""
    if threads:
        torch.set_num_threads(threads)
    inp = torch.load(path)
    step = _step_fn(variant, inp)
    w = torch.ones((), dtype=inp["shard"].dtype, requires_grad=True)
    x = _fresh_logits(inp["shard"], w)
    base = _rss()
    if not _reset_peak():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
    grad = step(x)
    peak = _peak_rss()
    del grad
    queue.put((variant, max(0, peak - base)))


def _timings(variants, inp, reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall seconds, process CPU seconds) per variant and round."""
    steps = {v: _step_fn(v, inp) for v in variants}
    w = torch.ones((), dtype=inp["shard"].dtype, requires_grad=True)
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(reps + 1):  # round 0 is the warm-up
        for v, step in steps.items():
            x = _fresh_logits(inp["shard"], w)
            c0, t0 = time.process_time(), time.perf_counter()
            grad = step(x)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if round_:
                times[v].append(dt)
                cpu[v].append(dc)
            del grad, x
    return times, cpu


def _paired_ratio(times: dict[str, list[float]], variant: str) -> float:
    """Median over rounds of t(variant) / t(CE) in the same round: on a shared machine the load
    of one round hits both alike, so the paired ratio is steadier than the ratio of medians."""
    if "ce" not in times:
        return float("nan")
    return statistics.median(t / c for t, c in zip(times[variant], times["ce"]))


def run(args, kind: str) -> list[dict]:
    dtype = DTYPES[args.dtype]
    variants = args.variants.split(",")
    inp = make_inputs(kind, args.tokens, args.vocab_local, args.tp, args.top_k, dtype,
                      seed=args.seed, other="gather" in variants, pair=args.pair)
    facts = describe(inp)
    memory: dict[str, float] = {}
    if not args.no_memory:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "inputs.pt")
            torch.save(inp, path)
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            for variant in variants:
                mp.start_processes(_peak_memory, args=(variant, path, args.threads, queue),
                                   nprocs=1, join=True, start_method="spawn")
                name, mem = queue.get()
                memory[name] = mem
    times, cpu = _timings(variants, inp, args.reps)
    med = {v: statistics.median(t) for v, t in times.items()}
    rows = []
    for v in variants:
        rows.append(dict(
            inputs=kind, variant=v, dtype=args.dtype, tokens=args.tokens,
            vocab_local=args.vocab_local, tp=args.tp, top_k=args.top_k,
            threads=torch.get_num_threads(), reps=args.reps, median_s=med[v],
            times_s=times[v], vs_ce=med[v] / med["ce"] if "ce" in med else float("nan"),
            min_s=min(times[v]), vs_ce_paired=_paired_ratio(times, v),
            cpu_times_s=cpu[v], cpu_median_s=statistics.median(cpu[v]),
            vs_ce_paired_cpu=_paired_ratio(cpu, v),
            extra_peak_mib=memory.get(v, float("nan")) / 2**20,
            mem_vs_ce=(memory[v] / memory["ce"]) if memory.get("ce") else float("nan"),
            **facts))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=V_QWEN3,
                    help="the real vocabulary the shard is cut from (Qwen3's; --real: 49152)")
    ap.add_argument("--vocab-local", type=int, default=None,
                    help="V_local (default: one TP rank's shard of megatron's padded vocabulary, "
                         "megatron_pdm.arch.vocab_shard_width(--vocab, 128, --tp): 76032 for "
                         "Qwen3 at TP 2, 38016 at TP 4)")
    ap.add_argument("--tp", type=int, default=None, help="TP size (default 2; V = V_local * tp)")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--inputs", default="realistic,random", help="realistic and/or random")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="ce,op_inplace,op")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    ap.add_argument("--json", default=None, help="append one JSON line per row to this file")
    ap.add_argument("--real", action="store_true",
                    help="real model inputs: --inputs real, N 2048, V_local 16384 at TP 3 "
                         "unless given")
    ap.add_argument("--pair", default="bf16", help="real inputs: the RL pair (bf16 | step)")
    args = ap.parse_args()
    if args.real:
        args.inputs = "real"
        args.vocab = V_REAL
        if args.tp is None:
            args.tp = 3 if args.vocab_local is None else V_REAL // args.vocab_local
    if args.tp is None:
        args.tp = 2
    if args.vocab_local is None:
        args.vocab_local = vocab_shard_width(args.vocab, DIVISIBLE_BY, args.tp)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"N={args.tokens} V_local={args.vocab_local} (V={args.vocab_local * args.tp}, "
          f"TP={args.tp}) K={args.top_k} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"reps={args.reps}")
    print("| inputs | variant | fwd+bwd median (s) | vs CE | paired vs CE | min (s) | "
          "extra peak RSS (MiB) | vs CE |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.inputs.split(","):
        rows = run(args, kind)
        for r in rows:
            print(f"| {kind} | {r['variant']} | {r['median_s']:.3f} | {r['vs_ce']:.2f}x | "
                  f"{r['vs_ce_paired']:.2f}x | {r['min_s']:.3f} | "
                  f"{r['extra_peak_mib']:.0f} | {r['mem_vs_ce']:.2f}x |", flush=True)
        print(f"<!-- {kind}: row max in support {rows[0]['row_max_in_support']:.3f}, sampled "
              f"token in top-K {rows[0]['sampled_in_top_k']:.3f} -->", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
