"""Formats bench_op.py's JSON lines as docs/op.md's table (one row per shape / dtype / variant,
the 1- and 2-thread ratios side by side). Usage: python benchmarks/op_table.py runs/bench_op.jsonl"""

from __future__ import annotations

import json
import math
import sys

NAMES = {"ce": "Megatron `vocab_parallel_cross_entropy`",
         "op_inplace": "**token_stats, `inplace=True`** (the adapter's path)",
         "op": "token_stats, default (logits kept)",
         "gather": "all-gather full logits + `log_softmax`"}


def _fmt_mem(r: dict | None) -> str:
    if r is None or math.isnan(r["extra_peak_mib"]):
        return "-"
    return f"{r['extra_peak_mib']:.0f} MiB ({r['mem_vs_ce']:.2f}x)"


def table(rows: list[dict]) -> str:
    keys = []
    by = {}
    for r in rows:
        k = (r["inputs"], r["tokens"], r["vocab_local"], r["dtype"], r["variant"])
        if k not in by:
            keys.append(k)
            by[k] = {}
        by[k][r["threads"]] = r
    header = ("| inputs | N x V_local | logits | variant | 1 thread: s (vs CE) "
              "| 2 threads: s (vs CE) | extra peak RSS, 1 thread (vs CE) |")
    out = [header, "|---|---|---|---|---|---|---|"]
    for k in keys:
        inputs, n, v, dtype, variant = k
        cells = []
        for t in (1, 2):
            r = by[k].get(t)
            cells.append("-" if r is None else f"{r['median_s']:.3f} ({r['vs_ce']:.2f}x)")
        out.append(f"| {inputs} | {n} x {v} | {dtype} | {NAMES.get(variant, variant)} | "
                   f"{cells[0]} | {cells[1]} | {_fmt_mem(by[k].get(1))} |")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table([json.loads(line) for line in f if line.strip()]))
