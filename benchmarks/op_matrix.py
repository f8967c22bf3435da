"""The op-vs-CE matrix of docs/op.md: one driver that runs it and writes its table.

Cells: the op's in-place path (`op_inplace`, the Megatron adapter's) against megatron's
`vocab_parallel_cross_entropy` (`ce`), forward + backward, realistic RL inputs (support = the
behaviour top-20 with the sampled token folded in, benchmarks/bench_inputs.py), on one TP rank's
shard of the padded vocabulary (`megatron_pdm.arch.vocab_shard_width`, never by hand):

    the real model (SmolLM2-135M-Instruct, V 49,152) at TP 1 and 3,
    Qwen3 (V 151,936) at TP 2, 4 and 8,
    N 2,048 and 8,192 tokens, bf16 and fp32 logits, 1 and 2 torch threads.

Every cell is one `benchmarks/bench_op.py` process (paired alternating rounds: `vs_ce_paired`
is the median over rounds of op / CE in the same round, by wall time, and `vs_ce_paired_cpu`
the same by process CPU time, "-" for rows measured before it was recorded; peak extra RSS of
each variant in a fresh process), run under `nice`; the driver adds the CPU model (megatron_pdm/hostinfo.py) and
the 1-minute load average before and after the cell to each JSON line. bf16 cells run first, then
fp32, 1 thread before 2, N 2,048 before 8,192; `--until HH:MM` (UTC) stops before a cell that would start later;
a rerun skips the cells its output file already holds. Peak memory is measured at 1 thread
(`--memory-threads`), "-" elsewhere.

    python benchmarks/op_matrix.py run --out results/op_matrix/cpu.jsonl --until 17:05
    python benchmarks/op_matrix.py docs            # regenerates docs/op.md's op-matrix blocks
    python benchmarks/op_matrix.py check           # exit 1 if a block differs from its file

The docs block is `<!-- op-matrix PATH -->` ... `<!-- /op-matrix -->`;
tests/benchmarks/test_op_matrix.py checks that it equals what `docs` writes from the committed file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_pdm.arch import vocab_shard_width  # noqa: E402 (pure: no torch)
from megatron_pdm.analysis import doc_blocks  # noqa: E402 (stdlib only)
from megatron_pdm.hostinfo import cpu_id, cpu_model  # noqa: E402

VOCABS = {"real": 49152, "qwen3": 151936}
"""The vocabularies of the matrix: the real model's (SmolLM2-135M-Instruct) and Qwen3's."""

SHARDS = (("real", 1), ("real", 3), ("qwen3", 2), ("qwen3", 4), ("qwen3", 8))
"""(vocabulary, TP) of every cell."""

TOKENS = (2048, 8192)
DTYPES = ("bf16", "fp32")
THREADS = (1, 2)
DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by default
DOC = "docs/op.md"
# the marker of that block, as tests/benchmarks/test_op_matrix.py reads it
BLOCK = re.compile(r"(<!-- op-matrix (\S+) -->\n)(.*?)(<!-- /op-matrix -->)", re.S)


def shard_width(vocab: str, tp: int) -> int:
    """V_local of one TP rank of `vocab` (megatron's padding rule)."""
    return vocab_shard_width(VOCABS[vocab], DIVISIBLE_BY, tp)


def cells(dtypes=DTYPES, tokens=TOKENS, threads=THREADS) -> list[dict]:
    """The matrix in run order: dtype (bf16 first), threads, N, shard."""
    return [dict(dtype=d, tokens=n, vocab=v, tp=tp, vocab_local=shard_width(v, tp), threads=t)
            for d in dtypes for t in threads for n in tokens for v, tp in SHARDS]


def _command(cell: dict, reps: int, json_path: str, memory: bool, nice: int) -> list[str]:
    cmd = ["nice", "-n", str(nice), sys.executable, str(ROOT / "benchmarks" / "bench_op.py"),
           "--tokens", str(cell["tokens"]), "--vocab", str(VOCABS[cell["vocab"]]),
           "--tp", str(cell["tp"]), "--dtype", cell["dtype"], "--threads", str(cell["threads"]),
           "--reps", str(reps), "--inputs", "realistic", "--variants", "ce,op_inplace",
           "--json", json_path]
    return cmd if memory else cmd + ["--no-memory"]


def _done(out: str) -> set[tuple]:
    """The cells that already have rows in `out` (a rerun resumes after them)."""
    if not os.path.exists(out):
        return set()
    return {(r["dtype"], r["tokens"], r["vocab_local"], r["threads"]) for r in load(out)}


def run(out: str, *, dtypes, tokens, threads, reps: dict[int, int], until: str | None,
        memory_threads=(1,), nice: int = 5) -> list[dict]:
    """Runs the cells in order, appending their rows to `out` (cells already there are kept and
    skipped); peak memory is measured at the thread counts in `memory_threads` only (it does not
    depend on them; each measurement is two more processes). Returns the cells not run."""
    done = _done(out)
    stop = None
    if until:
        hh, mm = (int(x) for x in until.split(":"))
        stop = dt.datetime.now(dt.timezone.utc).replace(hour=hh, minute=mm, second=0)
    missing = []
    for cell in cells(dtypes, tokens, threads):
        if (cell["dtype"], cell["tokens"], cell["vocab_local"], cell["threads"]) in done:
            continue
        if stop is not None and dt.datetime.now(dt.timezone.utc) >= stop:
            missing.append(cell)
            continue
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.jsonl")
            memory = cell["threads"] in memory_threads
            proc = subprocess.run(_command(cell, reps[cell["tokens"]], path, memory, nice),
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
                missing.append(cell)
                continue
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        extra = dict(vocab_name=cell["vocab"], cpu_model=cpu_model(), cpu_id=cpu_id(),
                     load_before=load_before, load_after=os.getloadavg()[0],
                     finished_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        with open(out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, **extra}) + "\n")
        op = next(r for r in rows if r["variant"] == "op_inplace")
        print(f"{cell['dtype']} N {cell['tokens']} {cell['vocab']} TP {cell['tp']} "
              f"V_local {cell['vocab_local']} threads {cell['threads']}: paired "
              f"{op['vs_ce_paired']:.2f}x, memory {op['mem_vs_ce']:.2f}x, load "
              f"{load_before:.1f}-{extra['load_after']:.1f}", flush=True)
    return missing


def _fmt(x: float, digits: int = 2, suffix: str = "x") -> str:
    return "-" if x != x else f"{x:.{digits}f}{suffix}"  # x != x: NaN (not measured)


def table(rows: list[dict]) -> str:
    """The docs table: one line per cell (op_inplace against CE of the same run)."""
    ce = {}
    for r in rows:
        if r["variant"] == "ce":
            ce[(r["dtype"], r["tokens"], r["vocab_local"], r["threads"], r["finished_utc"])] = r
    order = {(d, n, shard_width(v, tp)): i for i, (d, n, v, tp) in enumerate(
        (c["dtype"], c["tokens"], c["vocab"], c["tp"]) for c in cells(threads=(1,)))}
    ops = sorted((r for r in rows if r["variant"] == "op_inplace"),
                 key=lambda r: (order.get((r["dtype"], r["tokens"], r["vocab_local"]), 1 << 30),
                                r["threads"], r["finished_utc"]))
    out = ["| logits | N | vocabulary, TP | V_local | threads | CE median s | op median s "
           "| op / CE paired | op / CE paired, CPU time | op / CE of medians "
           "| extra peak RSS MiB, CE / op | memory op / CE | rounds | load 1 min | CPU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ops:
        c = ce[(r["dtype"], r["tokens"], r["vocab_local"], r["threads"], r["finished_utc"])]
        name = "real model" if r["vocab_name"] == "real" else "Qwen3"
        mem = ("-" if c["extra_peak_mib"] != c["extra_peak_mib"]
               else f"{c['extra_peak_mib']:.0f} / {r['extra_peak_mib']:.0f}")
        out.append(
            f"| {r['dtype']} | {r['tokens']} | {name}, TP {r['tp']} | {r['vocab_local']} "
            f"| {r['threads']} | {c['median_s']:.3f} | {r['median_s']:.3f} "
            f"| **{_fmt(r['vs_ce_paired'])}** | {_fmt(r.get('vs_ce_paired_cpu', math.nan))} "
            f"| {_fmt(r['vs_ce'])} | {mem} "
            f"| {_fmt(r['mem_vs_ce'])} | {r['reps']} "
            f"| {r['load_before']:.1f}-{r['load_after']:.1f} | {r['cpu_model']}"
            f"{' (' + r['cpu_id'] + ')' if r.get('cpu_id') else ''} |")
    return "\n".join(out) + "\n"


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _block(full: str, path: str) -> str:
    return table(load(full))


# the docs block, rendered by the project's one block mechanism (megatron_pdm/analysis/doc_blocks.py)
KIND = {"op-matrix": _block}


def render(text: str, root: str = ".") -> str:
    """`text` with every op-matrix block regenerated from its file (paths relative to root)."""
    return doc_blocks.render_text(text, root, KIND)


def check_doc(doc: str = DOC, root: str = ".") -> list[str]:
    """The files whose block in `doc` differs from what `render` writes."""
    doc = doc if os.path.isabs(doc) else os.path.join(root, doc)
    return [b.split(" ", 1)[1] for b in doc_blocks.check(doc, root, KIND)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--dtypes", default=",".join(DTYPES))
    r.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    r.add_argument("--threads", default=",".join(map(str, THREADS)))
    r.add_argument("--reps", default="2048:5,8192:2", help="rounds per N (N:reps,...)")
    r.add_argument("--until", default=None, help="HH:MM UTC: start no cell at or after it")
    r.add_argument("--memory-threads", default="1",
                   help="thread counts whose cells also measure peak memory ('' for none)")
    r.add_argument("--nice", type=int, default=5)
    for name in ("docs", "check"):
        sub.add_parser(name).add_argument("--doc", default=DOC)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        reps = {int(k): int(v) for k, v in (x.split(":") for x in args.reps.split(","))}
        missing = run(args.out, dtypes=args.dtypes.split(","),
                      tokens=[int(x) for x in args.tokens.split(",")],
                      threads=[int(x) for x in args.threads.split(",")], reps=reps,
                      until=args.until, nice=args.nice,
                      memory_threads=[int(x) for x in args.memory_threads.split(",") if x])
        for cell in missing:
            print("not run:", json.dumps(cell))
        return 0
    path = ROOT / args.doc
    if args.cmd == "docs":
        path.write_text(render(path.read_text(), str(ROOT)))
        return 0
    bad = check_doc(str(path), str(ROOT))
    for b in bad:
        print(f"{args.doc}: the op-matrix block of {b} differs from what `docs` writes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
