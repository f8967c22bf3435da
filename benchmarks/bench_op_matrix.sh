#!/usr/bin/env bash
# The op benchmark matrix of docs/op.md: realistic and random inputs, fp32 and bf16,
# 1 and 2 torch threads, Qwen3's padded vocabulary at TP 2 (V_local 76032) and TP 4 (38016; both
# from megatron_pdm.arch.vocab_shard_width, bench_op.py's default for --tp), N up to
# 8192. Every row is a ratio against Megatron's vocab_parallel_cross_entropy measured in the same
# process (benchmarks/bench_op.py). Output: one JSON line per row in $OUT (default
# runs/bench_op.jsonl) and the docs/op.md table on stdout (benchmarks/op_table.py).
# Usage: benchmarks/bench_op_matrix.sh [--quick]     (~20 min on 2 idle cores; --quick: N=512)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-runs/bench_op.jsonl}"
mkdir -p "$(dirname "$OUT")"; : > "$OUT"
N_MAIN=2048; N_BIG=8192; REPS=5
if [ "${1:-}" = "--quick" ]; then N_MAIN=512; N_BIG=512; REPS=2; fi
for threads in 1 2; do
  # N=2048 at TP 2, every variant, both inputs, peak memory
  "$PY" benchmarks/bench_op.py --tokens $N_MAIN --tp 2 --dtype fp32 --threads $threads \
      --reps $REPS --inputs realistic,random --variants ce,op_inplace,op --json "$OUT"
  "$PY" benchmarks/bench_op.py --tokens $N_MAIN --tp 2 --dtype bf16 --threads $threads \
      --reps $REPS --inputs realistic,random --variants ce,op_inplace --json "$OUT"
  # N=8192 at TP 4 (the adapter path, realistic inputs)
  for dtype in fp32 bf16; do
    "$PY" benchmarks/bench_op.py --tokens $N_BIG --tp 4 --dtype $dtype \
        --threads $threads --reps 3 --inputs realistic --variants ce,op_inplace --no-memory --json "$OUT"
  done
done
"$PY" benchmarks/op_table.py "$OUT"
