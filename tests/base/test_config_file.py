"""Config files on disk (megatron_pdm/configfile.py): a cut, changing or empty file is refused with
an error naming it, a driver-written config carries its digest and is replaced atomically, and a
key given twice is still refused."""

from __future__ import annotations

import os
import threading

import pytest
import yaml

from megatron_pdm import configfile, fsutil
from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.configtree import ConfigError
from megatron_pdm.train.config import RunConfig

FULL = "seed: 7\ntrain:\n  lr: 0.0003\n  iterations: 200\n"


def test_a_file_cut_mid_value_is_refused_naming_the_file_and_its_last_line(tmp_path):
    path = tmp_path / "cut.yaml"
    cut = FULL[:FULL.index("200") + 1]  # "iterations: 2": still valid yaml, a different value
    assert yaml.safe_load(cut)["train"]["iterations"] == 2
    path.write_text(cut)
    with pytest.raises(ConfigError) as err:
        RunConfig.load(str(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}: the last line '  iterations: 2' does not end with a newline")
    assert "end the file with a newline" in msg
    path.write_text(FULL)
    assert RunConfig.load(str(path)).train.iterations == 200


def test_a_long_last_line_is_shortened_in_the_message(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("output_dir: " + "x" * 200)
    with pytest.raises(ConfigError, match=r"'output_dir: x+\.\.\.' does not end"):
        RunConfig.load(str(path))


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"{path}: empty file \(0 bytes"):
        RunConfig.load(str(path))
    path.write_text("# defaults only\n")  # comments, ending in a newline: the defaults
    assert RunConfig.load(str(path)) == RunConfig()


def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text(FULL)
    real = configfile._read_all

    def read_then_someone_appends(f):
        data = real(f)
        with open(path, "a") as g:
            g.write("warmup:\n  steps: 3\n")
        return data

    monkeypatch.setattr(configfile, "_read_all", read_then_someone_appends)
    with pytest.raises(ConfigError, match=rf"{path}: changed while it was read \(\d+ bytes before, "
                                          r"\d+ after"):
        RunConfig.load(str(path))


def test_a_pipe_is_read_without_the_size_check(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)

    def writer():
        with open(fifo, "w") as f:
            f.write(FULL)

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert RunConfig.load(str(fifo)).seed == 7
    finally:
        t.join(10)


def test_the_saved_run_config_carries_its_digest_and_loads_back(tmp_path):
    cfg = RunConfig.load(None, ["seed=11", "train.lr=1e-4"])
    path = tmp_path / "config.yaml"
    cfg.save(path)
    text = path.read_text()
    first, body = text.split("\n", 1)
    assert first.startswith("# written by megatron-pdm: sha256 ") and "delete this line" in first
    assert RunConfig.load(str(path)) == cfg
    assert yaml.safe_load(text) == cfg.to_dict()  # still plain yaml for other readers


def test_a_saved_config_cut_at_a_line_boundary_is_refused(tmp_path):
    path = tmp_path / "config.yaml"
    RunConfig().save(path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-3]))  # whole lines lost: ends in a newline, parses
    yaml.safe_load(path.read_text())
    with pytest.raises(ConfigError, match=rf"{path}: \d+ bytes below its first line, which says "
                                          r"\d+ \(written by the driver; truncated"):
        RunConfig.load(str(path))


def test_a_saved_config_changed_since_is_refused_and_loads_once_the_line_is_dropped(tmp_path):
    path = tmp_path / "config.yaml"
    RunConfig.load(None, ["seed=1234"]).save(path)
    edited = path.read_text().replace("seed: 1234", "seed: 4321")  # same length
    path.write_text(edited)
    with pytest.raises(ConfigError, match=rf"{path}: its content does not match the sha256 .* "
                                          "must drop that first line"):
        RunConfig.load(str(path))
    path.write_text(edited.split("\n", 1)[1])
    assert RunConfig.load(str(path)).seed == 4321


def test_the_saved_config_is_replaced_atomically(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    RunConfig.load(None, ["seed=1"]).save(path)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(fsutil.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        RunConfig.load(None, ["seed=2"]).save(path)
    assert path.read_bytes() == before  # the old file, whole
    assert os.listdir(tmp_path) == ["config.yaml"]  # no temporary file left behind


def test_duplicate_keys_are_refused_in_nested_sections_and_in_loss_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  vllm:\n    url: http://a\n    url: http://b\n")
    with pytest.raises(ConfigError, match=rf"{path}:4: key 'url' given twice \(first on line 3\)"):
        RunConfig.load(str(path))
    loss = tmp_path / "loss.yaml"
    loss.write_text("preset: pdm-agg\ndelta_high: 0.2\ndelta_high: 0.3\n")
    with pytest.raises(ConfigError, match=rf"{loss}:3: key 'delta_high' given twice"):
        PolicyLossConfig.from_yaml(loss)


def test_loss_files_get_the_same_truncation_rule(tmp_path):
    loss = tmp_path / "loss.yaml"
    loss.write_text("preset: pdm-agg\ndelta_high: 0.2")
    with pytest.raises(ConfigError, match=rf"{loss}: the last line 'delta_high: 0.2' does not"):
        PolicyLossConfig.from_yaml(loss)
