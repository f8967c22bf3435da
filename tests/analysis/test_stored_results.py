"""Stored study results: the docs' generated tables equal what `megatron-pdm-study-report`
generates from the committed files, and a stored copy recomputes its study's summary."""

from __future__ import annotations

import json
import pathlib

import pytest

from megatron_pdm.analysis import doc_blocks, main_job, stored
from megatron_pdm.analysis.controls import build_controls
from megatron_pdm.analysis.power import pilot_sd
from megatron_pdm.analysis.counting import count_seed
from megatron_pdm.tools import study_report
from tests.analysis.test_controls import _criteria, _study, _tables

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "mask-study.md"
# the docs whose results blocks are generated (Makefile RESULTS_DOCS, `make results-docs`)
DOCS = ["README.md", "docs/mask-study.md", "docs/main-job.md", "docs/stability.md"]
KINDS = study_report.kinds()  # the analysis kinds and the stability grid's


def test_makefile_regenerates_exactly_these_docs():
    make = (ROOT / "Makefile").read_text()
    line = next(ln for ln in make.splitlines() if ln.startswith("RESULTS_DOCS :="))
    assert line.split(":=")[1].split() == DOCS


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_blocks_are_what_the_command_generates_from_the_committed_files(doc):
    text = (ROOT / doc).read_text()
    blocks = [m for m in doc_blocks.BLOCK.finditer(text) if m.group(2) in KINDS]
    assert blocks, f"{doc} has no generated results block"
    for m in blocks:
        path = m.group(3)
        assert (ROOT / path).exists(), f"{path}: named by {doc}, not committed"
        assert path.startswith(("results/mask_study/", "results/main_job", "results/stability/"))
    assert doc_blocks.check(str(ROOT / doc), str(ROOT), KINDS) == []


def test_mask_study_page_shows_every_stored_study():
    text = DOC.read_text()
    shown = {m.group(3) for m in doc_blocks.BLOCK.finditer(text) if m.group(2) == "study-table"}
    stored_files = {str(p.relative_to(ROOT)) for p in (ROOT / "results" / "mask_study").glob(
        "*/results.json")}
    assert stored_files - {"results/mask_study/small-pilot/results.json"} <= shown


@pytest.mark.parametrize("doc", DOCS)
def test_a_changed_number_is_caught(tmp_path, doc):
    target = tmp_path / "doc.md"
    text = (ROOT / doc).read_text()
    mt = next(m for m in doc_blocks.BLOCK.finditer(text) if m.group(2) in KINDS)
    body = mt.group(4)
    i = next(k for k, ch in enumerate(body) if ch.isdigit())
    changed = body[:i] + str((int(body[i]) + 1) % 10) + body[i + 1:]
    target.write_text(text.replace(mt.group(0), mt.group(0).replace(body, changed, 1), 1))
    assert doc_blocks.check(str(target), str(ROOT), KINDS) == [f"{mt.group(2)} {mt.group(3)}"]
    doc_blocks.update(str(target), str(ROOT), KINDS)
    assert target.read_text() == text


def test_a_stored_run_round_trips_into_the_table(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    summary = json.loads((ROOT / "results/main_job/2026-12-03_seed1234_t1/summary.json")
                         .read_text())
    summary.update(seed=7, torch_threads=2, cpu_model="Test CPU", greedy_acc_after_rl=0.25)
    (run / "summary.json").write_text(json.dumps(summary))
    folder = tmp_path / "main_job"
    main_job.store(str(run), str(folder / "r7"), command="make demo SEED=7 THREADS=2")
    assert json.loads((folder / "r7" / "run.json").read_text())["command"] == (
        "make demo SEED=7 THREADS=2")
    table = main_job.doc_table(str(folder))
    assert "| r7 |" in table and "| Test CPU | 2 | 7 |" in table
    line = main_job.doc_line(str(folder))
    assert "higher in 0 of 1" in line   # 0.297 -> 0.25: a fall is reported as a fall
    (folder / "r8").mkdir()
    (folder / "r8" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(FileNotFoundError, match="run.json"):
        main_job.doc_table(str(folder))


def test_store_keeps_counts_and_recomputes_the_summary(tmp_path):
    summary, controls = _study(flip=0.5)
    crit = _criteria()
    seeds = list(range(1, 31))
    per_seed = []
    for s in seeds:
        before, after = _tables(s)
        per_seed.append(dict(count_seed(crit, before, after, controls=controls, control_seed=s),
                             seed=s))
    setup = {"criteria": ["ratio", "pdm-agg"], "delta_kl": 0.05, "delta_tv": 0.2,
             "controls": [vars(c) for c in build_controls("ratio", ["ratio", "pdm-agg"],
                                                          flip=0.5)],
             "primary": "pdm-agg:ratio", "power": None, "seeds": seeds,
             "machine": {"cpu_model": "test"}}
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"setup": setup, "summary": summary, "per_seed": per_seed}))
    path = stored.store(str(full), str(tmp_path / "stored"))
    kept = json.loads(pathlib.Path(path).read_text())
    assert "summary" not in kept
    assert "unsafe_keep_rate" not in kept["per_seed"][0]["criteria"]["ratio"]
    again = json.loads(json.dumps(stored.recompute(kept)))
    assert again["paired"] == json.loads(json.dumps(summary["paired"]))
    assert again["controls_check"]["ok"]
    # a stored pilot gives its SD (the primary's paired difference) like the full file
    assert pilot_sd(path, "pdm-agg") == pytest.approx(pilot_sd(str(full), "pdm-agg"))
