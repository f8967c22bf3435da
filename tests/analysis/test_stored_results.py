"""Stored study results: the docs' generated tables equal what `megatron-pdm-study-report`
generates from the committed files, and a stored copy recomputes its study's summary."""

from __future__ import annotations

import json
import pathlib

import pytest

from megatron_pdm.analysis import stored
from megatron_pdm.analysis.controls import build_controls
from megatron_pdm.analysis.power import pilot_sd
from megatron_pdm.analysis.counting import count_seed
from tests.analysis.test_controls import _criteria, _study, _tables

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "mask-study.md"


def test_the_docs_tables_are_what_the_command_generates_from_the_committed_files():
    text = DOC.read_text()
    blocks = stored.BLOCK.findall(text)
    assert blocks, "docs/mask-study.md has no generated study-table block"
    for _, path, _, _ in blocks:
        assert (ROOT / path).is_file(), f"{path}: named by docs/mask-study.md, not committed"
        assert path.startswith("results/mask_study/")
    assert stored.check_doc(str(DOC), str(ROOT)) == []


def test_a_changed_number_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    text = DOC.read_text()
    mt = next(stored.BLOCK.finditer(text))
    body = mt.group(3)
    i = next(k for k, ch in enumerate(body) if ch.isdigit() and k > body.index("|"))
    changed = body[:i] + str((int(body[i]) + 1) % 10) + body[i + 1:]
    doc.write_text(text.replace(body, changed, 1))
    assert stored.check_doc(str(doc), str(ROOT)) == [mt.group(2)]
    stored.update_doc(str(doc), str(ROOT))
    assert doc.read_text() == text


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
