"""The GPU side of the op-vs-CE matrix (benchmarks/op_matrix.py): bf16 logits, Qwen3's shards.

`run_matrix(sz)` is benchmarks/gpu_check.py's part "op_matrix": the cells of op_matrix.py with
dtype bf16 and the Qwen3 vocabulary (TP 2, 4, 8: V_local 76,032 / 38,016 / 19,072 from
`megatron_pdm.arch.vocab_shard_width`), N 2,048 and 8,192, the same realistic inputs
(benchmarks/bench_inputs.py, made on the CPU and moved to the device) and the same two variants
as the CPU matrix: megatron's `vocab_parallel_cross_entropy` (`ce`) and `token_stats(...,
inplace=True, validate=False)` (`op_inplace`), forward + backward to a non-leaf logits tensor.

Timing: paired alternating rounds, as benchmarks/bench_op.py does on the CPU: in every round each
variant runs once between device synchronisations; `vs_ce_paired` is the median over rounds of
op / CE in the same round. Memory: the peak of `torch.cuda.max_memory_allocated` over one step of
each variant minus the allocation before it (None on the CPU, where the smoke mode runs).
Megatron's CE runs on the tensor-parallel group the caller initialised (world size 1).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import op_matrix  # noqa: E402 (the cell list of the CPU matrix)

VARIANTS = ("ce", "op_inplace")


def gpu_cells(tokens=op_matrix.TOKENS) -> list[dict]:
    """The bf16 Qwen3 cells of the CPU matrix (threads do not apply on a GPU)."""
    return [c for c in op_matrix.cells(dtypes=("bf16",), tokens=tokens, threads=(0,))
            if c["vocab"] == "qwen3"]


def _steps(inp: dict):
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # Skip if absent

    import megatron_pdm as pdm

    sampled, ids, lp, valid = inp["sampled"], inp["ids"], inp["logprobs"], inp["valid"]
    vocab = inp["shard"].shape[1]  # rank 0's shard alone: ids >= V_local are other ranks'

    def ce(x):
        loss = vocab_parallel_cross_entropy(x[:, None], sampled[:, None]).sum()
        return torch.autograd.grad(loss, x)[0]

    def op_inplace(x):
        stats = pdm.token_stats(x, sampled, ids, lp, valid, vocab_size=vocab, validate=False,
                                inplace=True, tp_group=None)
        return torch.autograd.grad(stats.logprob.sum(), x)[0]

    return {"ce": ce, "op_inplace": op_inplace}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def paired_cell(inp: dict, rounds: int) -> dict:
    """Times and peak memory of both variants on one cell's inputs (already on the device)."""
    import torch

    device = inp["shard"].device
    cuda = device.type == "cuda"
    steps = _steps(inp)
    w = torch.ones((), dtype=inp["shard"].dtype, device=device, requires_grad=True)
    times = {v: [] for v in steps}
    peak = {}
    for round_ in range(rounds + 1):  # round 0: warm-up, and the memory peaks
        for name, step in steps.items():
            x = inp["shard"] * w  # a non-leaf, as inside megatron; CE and the op overwrite it
            _sync(device)
            if cuda and round_ == 0:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            grad = step(x)
            _sync(device)
            if round_:
                times[name].append(time.perf_counter() - t0)
            elif cuda:
                peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
            del grad, x
    med = {v: statistics.median(t) for v, t in times.items()}
    paired = statistics.median(o / c for o, c in zip(times["op_inplace"], times["ce"]))
    return {"ce_ms": med["ce"] * 1e3, "op_ms": med["op_inplace"] * 1e3,
            "vs_ce_paired": paired, "vs_ce": med["op_inplace"] / med["ce"],
            "ce_peak_mib": peak.get("ce"), "op_peak_mib": peak.get("op_inplace"),
            "memory_vs_ce": (peak["op_inplace"] / peak["ce"]) if peak.get("ce") else None,
            "rounds": rounds}


def run_matrix(sz: dict) -> dict:
    """gpu_check's part: every bf16 Qwen3 cell at sz["matrix_tokens"], sz["matrix_rounds"]."""
    import torch

    from bench_inputs import make_inputs

    device = torch.device(sz["device"])
    rows = []
    for tokens in sz["matrix_tokens"]:
        cells = gpu_cells((tokens,))
        # one generation per N, at the widest shard (TP 2); a narrower shard is its prefix of
        # columns (the support ids beyond it belong to other ranks, as on rank 0 of that TP)
        widest = max(cells, key=lambda c: c["vocab_local"])
        full = make_inputs("realistic", tokens, widest["vocab_local"], widest["tp"], 20,
                           torch.bfloat16, seed=0)
        for cell in cells:
            inp = {k: v.to(device) if torch.is_tensor(v) else v for k, v in full.items()}
            inp["shard"] = inp["shard"][:, : cell["vocab_local"]].contiguous()
            rows.append({**{k: cell[k] for k in ("dtype", "tokens", "vocab", "tp",
                                                 "vocab_local")},
                         **paired_cell(inp, sz["matrix_rounds"])})
            del inp
        del full
    return {"rows": rows, "variants": list(VARIANTS), "validate": False}
