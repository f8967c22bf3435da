"""The study's per-seed log (megatron_pdm/analysis/seed_log.py): a killed study keeps the seeds
it finished; a new study in the same directory never appends to or deletes an old log."""

from __future__ import annotations

import json
import math
import os

import pytest

from megatron_pdm.analysis.seed_log import PARTIAL_NAME, SeedLog, read_partial


def test_each_seed_is_a_line_on_disk_as_it_is_appended(tmp_path):
    log = SeedLog(str(tmp_path), enabled=True)
    assert read_partial(str(tmp_path)) == []  # created at start: the study began
    log.append({"seed": 1, "rate": 0.5, "bad": math.inf})
    assert read_partial(str(tmp_path)) == [{"seed": 1, "rate": 0.5, "bad": None}]
    log.append({"seed": 2, "rate": None})
    assert [r["seed"] for r in read_partial(str(tmp_path))] == [1, 2]


def test_disabled_rank_writes_nothing(tmp_path):
    log = SeedLog(str(tmp_path / "out"), enabled=False)
    log.append({"seed": 1})
    assert not (tmp_path / "out").exists()


def test_a_new_study_moves_the_old_log_aside(tmp_path):
    SeedLog(str(tmp_path), enabled=True).append({"seed": 1, "study": "first"})
    SeedLog(str(tmp_path), enabled=True).append({"seed": 1, "study": "second"})
    SeedLog(str(tmp_path), enabled=True)
    path = os.path.join(str(tmp_path), PARTIAL_NAME)
    with open(path + ".old-1") as f:
        assert json.loads(f.readline())["study"] == "first"
    with open(path + ".old-2") as f:
        assert json.loads(f.readline())["study"] == "second"
    assert read_partial(str(tmp_path)) == []


def test_a_line_cut_by_a_crash_is_dropped_any_other_bad_line_is_an_error(tmp_path):
    log = SeedLog(str(tmp_path), enabled=True)
    log.append({"seed": 1})
    path = os.path.join(str(tmp_path), PARTIAL_NAME)
    with open(path, "a") as f:
        f.write('{"seed": 2, "rat')  # killed mid-write: no newline
    assert read_partial(str(tmp_path)) == [{"seed": 1}]
    with open(path, "a") as f:
        f.write('\n{"seed": 3}\n')
    with pytest.raises(ValueError, match=rf"{PARTIAL_NAME}:2: not a JSON record"):
        read_partial(str(tmp_path))
