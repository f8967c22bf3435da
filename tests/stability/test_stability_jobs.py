"""The stability grid's cells side by side (`--jobs`): every cell recorded once, the written
results in the grid's order whatever finished first, a failed cell stops the grid without losing
the cells that finished. The driver runs are replaced by a stand-in that writes a record's inputs
(the real runs are tests/stability/test_stability_smoke.py's)."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_pdm.stability import grid as G
from megatron_pdm.stability import run


def _grid(seeds=(1, 2, 3)) -> G.Grid:
    return G.Grid(["no-trust-region", "pdm-agg"], ["base", "epochs4"], list(seeds))


@pytest.fixture
def fake_runs(monkeypatch):
    """compare.run_one / shared_warmup / run_record replaced; returns what the stand-in saw."""
    seen = {"started": [], "running": 0, "max_running": 0, "fail": set(), "log_paths": []}
    lock = threading.Lock()

    def run_one(config, preset, seed, out, warm_dir, overrides, nproc, threads, prefix,
                log_path=None):
        name = out.rsplit("/", 1)[-1]
        with lock:
            seen["started"].append(name)
            seen["log_paths"].append(log_path)
            seen["running"] += 1
            seen["max_running"] = max(seen["max_running"], seen["running"])
        # later cells finish first: records.jsonl is then not in grid order
        time.sleep(0.02 * (1 + (len(seen["started"]) % 3)))
        with lock:
            seen["running"] -= 1
        if name in seen["fail"]:
            raise RuntimeError(f"driver run {name} failed")

    monkeypatch.setattr(run.compare, "run_one", run_one)
    monkeypatch.setattr(run.compare, "shared_warmup",
                        lambda *a, **k: {"evals": {"before_rl": 0.25}})
    monkeypatch.setattr(run.S, "run_record",
                        lambda run_dir, cell, wall_s: {"cell": cell.name, "wall_s": wall_s})
    return seen


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_every_cell_recorded_once_and_results_in_grid_order(tmp_path, fake_runs, jobs):
    grid = _grid()
    records = run.run_grid(grid, config="c.yaml", out=str(tmp_path), warmup_overrides=[],
                           jobs=jobs, log=lambda *_: None)
    names = [c.name for c in grid.cells()]
    assert sorted(r["cell"] for r in records) == sorted(names)
    assert [r["cell"] for r in run.in_grid_order(grid, records)] == names
    assert fake_runs["max_running"] <= jobs
    # side by side, each cell's output goes to its own log, not to ours
    assert all((p is None) == (jobs == 1) for p in fake_runs["log_paths"])
    # a second call runs nothing: every cell has its record
    fake_runs["started"].clear()
    run.run_grid(grid, config="c.yaml", out=str(tmp_path), warmup_overrides=[], jobs=jobs,
                 log=lambda *_: None)
    assert fake_runs["started"] == []


def test_cells_really_run_side_by_side(tmp_path, fake_runs):
    run.run_grid(_grid(), config="c.yaml", out=str(tmp_path), warmup_overrides=[], jobs=3,
                 log=lambda *_: None)
    assert fake_runs["max_running"] >= 2


def test_a_failed_cell_keeps_the_finished_ones_and_starts_nothing_new(tmp_path, fake_runs):
    grid = _grid(seeds=(1, 2, 3, 4, 5))
    names = [c.name for c in grid.cells()]
    fake_runs["fail"].add(names[2])
    with pytest.raises(RuntimeError, match=names[2]):
        run.run_grid(grid, config="c.yaml", out=str(tmp_path), warmup_overrides=[], jobs=2,
                     log=lambda *_: None)
    recorded = {r["cell"] for r in run.read_records(str(tmp_path))}
    started = set(fake_runs["started"])
    assert names[2] not in recorded
    assert recorded == started - {names[2]}  # every other started cell finished and was kept
    assert len(started) < len(names)  # the rest never started
    # the rerun (the failure fixed) runs exactly the cells without a record
    fake_runs["fail"].clear()
    fake_runs["started"].clear()
    run.run_grid(grid, config="c.yaml", out=str(tmp_path), warmup_overrides=[], jobs=2,
                 log=lambda *_: None)
    assert sorted(fake_runs["started"]) == sorted(set(names) - recorded)


def test_jobs_checked_and_default_from_the_cores(monkeypatch):
    with pytest.raises(ValueError, match="jobs"):
        run.run_grid(_grid(), config="c.yaml", out="unused", warmup_overrides=[], jobs=0)
    monkeypatch.setattr(run.os, "cpu_count", lambda: 2)
    assert run.default_jobs(1, 1) == 2
    assert run.default_jobs(2, 1) == 1 and run.default_jobs(1, 2) == 1
    monkeypatch.setattr(run.os, "cpu_count", lambda: None)
    assert run.default_jobs(1, 1) == 1


def test_rerecord_rebuilds_from_the_run_folders_and_keeps_the_old_file(tmp_path, monkeypatch):
    grid = _grid(seeds=(1,))
    cells = grid.cells()
    for cell in cells:
        run.append_record(str(tmp_path), {"cell": cell.name, "method": cell.method,
                                          "setting": cell.setting, "seed": cell.seed,
                                          "wall_s": 7.0, "end": {"old": 1}})
    for cell in cells[:-1]:  # the last cell's run folder is gone
        (tmp_path / "runs" / cell.name).mkdir(parents=True)
        (tmp_path / "runs" / cell.name / "summary.json").write_text("{}")
    monkeypatch.setattr(run.S, "run_record", lambda run_dir, cell, wall_s: {
        "cell": cell.name, "method": cell.method, "setting": cell.setting, "seed": cell.seed,
        "wall_s": wall_s, "end": {"new": run_dir.endswith(cell.name)}})
    before = (tmp_path / "records.jsonl").read_text()
    assert run.rerecord(str(tmp_path), log=lambda *_: None) == len(cells) - 1
    records = run.read_records(str(tmp_path))
    assert [r["cell"] for r in records] == [c.name for c in cells]
    assert all(r["end"] == {"new": True} and r["wall_s"] == 7.0 for r in records[:-1])
    assert records[-1]["end"] == {"old": 1}
    assert (tmp_path / "records.jsonl.before-rerecord").read_text() == before
    # a second rebuild keeps the first copy (the run's own file) and copies to the next name
    after_first = (tmp_path / "records.jsonl").read_text()
    run.rerecord(str(tmp_path), log=lambda *_: None)
    assert (tmp_path / "records.jsonl.before-rerecord").read_text() == before
    assert (tmp_path / "records.jsonl.before-rerecord.2").read_text() == after_first


def test_rerecord_killed_before_the_rename_leaves_the_records_whole(tmp_path, monkeypatch):
    cell = _grid(seeds=(1,)).cells()[0]
    run.append_record(str(tmp_path), {"cell": cell.name, "method": cell.method,
                                      "setting": cell.setting, "seed": cell.seed, "wall_s": 1.0})
    before = (tmp_path / "records.jsonl").read_text()

    real_replace = run.os.replace

    def killed(src, dst):  # every rename but the new file's goes through; that one dies
        if str(src).endswith(".tmp"):
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(run.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run.rerecord(str(tmp_path), log=lambda *_: None)
    assert (tmp_path / "records.jsonl").read_text() == before


def test_a_cell_with_an_engine_server_counts_one_more_core(monkeypatch):
    monkeypatch.setattr(run.os, "cpu_count", lambda: 2)
    assert run.default_jobs(1, 1, server=True) == 1
    monkeypatch.setattr(run.os, "cpu_count", lambda: 16)
    assert run.default_jobs(1, 1, server=True) == 8 and run.default_jobs(1, 1) == 16
