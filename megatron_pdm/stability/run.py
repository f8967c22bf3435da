"""Runs the grid's cells as separate driver runs (torchrun) from one shared warm-up.

Each finished cell appends one record (its outcomes, summary.py) to `<out>/records.jsonl`; a
restarted grid skips cells that already have a record, so a killed grid keeps its runs.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

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


def default_jobs(nproc: int, threads: int, server: bool = False) -> int:
    """Cells side by side by default: as many as the machine's cores hold at `nproc` processes x
    `threads` threads per cell, plus one core for the cell's engine server when it starts one
    (at least one cell)."""
    per_cell = max(1, nproc * threads) + (1 if server else 0)
    return max(1, (os.cpu_count() or 1) // per_cell)


def run_grid(grid: Grid, *, config: str, out: str, warmup_overrides: list[str], nproc: int = 1,
             threads: int = 1, jobs: int = 1, log=print) -> list[dict]:
    """Shared warm-up, then every cell without a record, `jobs` at a time (each its own driver
    process; a cell's numbers do not depend on `jobs`). Returns all records.

    With jobs > 1 each cell's output goes to `runs/<cell>/driver.log`. A failed cell stops the
    grid: no new cell starts, the running ones finish and are recorded, then its error is raised
    (its log's tail printed first)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    os.makedirs(out, exist_ok=True)
    warm_dir = os.path.abspath(os.path.join(out, "warmup"))
    # the warm-up uses the grid's layout and sizes (seed: the config's own)
    warm = compare.shared_warmup(config, warm_dir, [*grid.sizes, *warmup_overrides], nproc,
                                 threads)
    if "before_rl" in warm["evals"]:  # none without a warm-up: each run measures its own
        log(f"stability: warm-up greedy accuracy {warm['evals']['before_rl']:.3f}")
    start_dir = warm.get("start_dir", warm_dir)  # warmup.steps=0: the config's load_dir
    done = {r["cell"] for r in read_records(out)}
    todo = [c for c in grid.cells() if c.name not in done]
    log(f"stability: {len(done)} cells already recorded, {len(todo)} to run, {jobs} at a time")
    t0 = time.time()

    def one(cell: Cell) -> dict:
        t1 = time.time()
        run_dir = os.path.join(out, "runs", cell.name)
        log_path = os.path.join(run_dir, "driver.log") if jobs > 1 else None
        try:
            compare.run_one(config, METHODS[cell.method], cell.seed, run_dir, start_dir,
                            grid.overrides(cell), nproc, threads, grid.launcher(cell, config),
                            log_path=log_path)
        except Exception:
            if log_path and os.path.exists(log_path):
                with open(log_path) as f:
                    log(f"stability: {cell.name} failed; the end of {log_path}:\n"
                        + "".join(f.readlines()[-30:]))
            raise
        return S.run_record(run_dir, cell, wall_s=time.time() - t1)

    def finished(k: int, record: dict) -> None:
        append_record(out, record)  # only this (the calling) thread writes records.jsonl
        took = time.time() - t0
        log(f"stability: {k}/{len(todo)} {record['cell']} {record['wall_s']:.0f} s, "
            f"~{took / k * (len(todo) - k):.0f} s left")

    if jobs == 1:
        for k, cell in enumerate(todo, 1):
            finished(k, one(cell))
        return read_records(out)
    error = None
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # threads only wait on driver processes
        futures = [pool.submit(one, cell) for cell in todo]  # submitted in seed-major order
        for k, fut in enumerate(as_completed(futures), 1):
            try:
                finished(k, fut.result())
            except Exception as e:  # keep the finished cells; start nothing new
                if error is None:
                    error = e
                    for f in futures:
                        f.cancel()
    if error is not None:
        raise error
    return read_records(out)


def rerecord(out: str, log=print) -> int:
    """Rebuilds every record of `out`/records.jsonl from its run's files (runs/<cell>/: metrics,
    summary), keeping its wall time: a record schema that gained an outcome needs no rerun. The
    file as it was is copied first to records.jsonl.before-rerecord (the first such copy is never
    overwritten: a later rerecord keeps it and writes .before-rerecord.2, ...), then the new file
    replaces records.jsonl in one rename, so a process killed at any point leaves a complete
    records.jsonl. A record whose run folder is gone stays as it was. Returns the number of
    records rebuilt."""
    path = os.path.join(out, RECORDS)
    old = read_records(out)
    new, rebuilt = [], 0
    for rec in old:
        cell = Cell(rec["method"], rec["setting"], int(rec["seed"]))
        run_dir = os.path.join(out, "runs", cell.name)
        if os.path.exists(os.path.join(run_dir, "summary.json")):
            new.append(S.run_record(run_dir, cell, wall_s=rec["wall_s"]))
            rebuilt += 1
        else:
            log(f"stability: {cell.name}: no run folder, its record kept as it was")
            new.append(rec)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for rec in new:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    backup, k = path + ".before-rerecord", 1
    while os.path.exists(backup):
        k += 1
        backup = f"{path}.before-rerecord.{k}"
    shutil.copy2(path, backup)
    os.replace(tmp, path)
    return rebuilt


def in_grid_order(grid: Grid, records: list[dict]) -> list[dict]:
    """The grid's records in its cell order (records.jsonl is in finishing order with jobs > 1),
    so the written results do not depend on which cell finished first."""
    order = {c.name: k for k, c in enumerate(grid.cells())}
    return sorted((r for r in records if r["cell"] in order), key=lambda r: order[r["cell"]])


__all__ = ["Cell", "RECORDS", "append_record", "default_jobs", "in_grid_order", "read_records",
           "rerecord", "run_grid"]
