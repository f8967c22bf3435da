"""Runs the grid's cells as separate driver runs (torchrun) from one shared warm-up.

Each finished cell appends one record (its outcomes, summary.py) to `<out>/records.jsonl`; a
restarted grid skips cells that already have a record, so a killed grid keeps its runs.
"""

from __future__ import annotations

import json
import os
import time

from megatron_pdm.stability import summary as S
from megatron_pdm.stability.grid import METHODS, Cell, Grid
from megatron_pdm.train import compare

RECORDS = "records.jsonl"


def read_records(out: str) -> list[dict]:
    path = os.path.join(out, RECORDS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_record(out: str, record: dict) -> None:
    with open(os.path.join(out, RECORDS), "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_grid(grid: Grid, *, config: str, out: str, warmup_overrides: list[str], nproc: int = 1,
             threads: int = 1, log=print) -> list[dict]:
    """Shared warm-up, then every cell without a record, sequentially. Returns all records."""
    os.makedirs(out, exist_ok=True)
    warm_dir = os.path.abspath(os.path.join(out, "warmup"))
    # the warm-up uses the grid's layout and sizes (seed: the config's own)
    warm = compare.shared_warmup(config, warm_dir, [*grid.sizes, *warmup_overrides], nproc,
                                 threads)
    if "before_rl" in warm["evals"]:  # none without a warm-up: each run measures its own
        log(f"stability: warm-up greedy accuracy {warm['evals']['before_rl']:.3f}")
    done = {r["cell"] for r in read_records(out)}
    todo = [c for c in grid.cells() if c.name not in done]
    log(f"stability: {len(done)} cells already recorded, {len(todo)} to run")
    t0 = time.time()
    for k, cell in enumerate(todo, 1):
        t1 = time.time()
        run_dir = os.path.join(out, "runs", cell.name)
        compare.run_one(config, METHODS[cell.method], cell.seed, run_dir,
                        warm.get("start_dir", warm_dir),  # warmup.steps=0: the config's load_dir
                        grid.overrides(cell), nproc, threads, grid.launcher(cell, config))
        record = S.run_record(run_dir, cell, wall_s=time.time() - t1)
        append_record(out, record)
        took = time.time() - t0
        log(f"stability: {k}/{len(todo)} {cell.name} {time.time() - t1:.0f} s, "
            f"~{took / k * (len(todo) - k):.0f} s left")
    return read_records(out)


__all__ = ["Cell", "RECORDS", "append_record", "read_records", "run_grid"]
