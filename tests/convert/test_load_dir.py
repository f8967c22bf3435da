"""The converted checkpoint's directory is Megatron-LM's `--load` layout (convert/load_dir.py).

Megatron-LM resolves `--load DIR` through `DIR/latest_checkpointed_iteration.txt`: "release"
means `DIR/release`, a number N means `DIR/iter_{N:07d}` (megatron/training/checkpointing.py:
get_checkpoint_tracker_filename, read_metadata, get_checkpoint_name). These tests pin that lookup
and the fallbacks the driver and the exporter accept (fast, no process group).
"""

from __future__ import annotations

import json

import pytest

from megatron_pdm.convert import load_dir as ld


def _dist_ckpt(path):
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return path


def test_release_layout_resolves_like_megatron_lm(tmp_path):
    top = tmp_path / "ckpt"
    _dist_ckpt(top / "release")
    (top / "pdm_model.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="latest_checkpointed_iteration.txt"):
        ld.weights_dir(top)  # no tracker yet: an interrupted import is not a checkpoint
    ld.write_tracker(top)
    assert (top / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert ld.weights_dir(top) == str(top / "release")
    # the inner directory is accepted too, and pdm_model.json is found above it
    assert ld.weights_dir(top / "release") == str(top / "release")
    assert ld.meta_dir(top / "release") == top and ld.meta_dir(top) == top


def test_iteration_tracker_and_flat_checkpoints(tmp_path):
    top = tmp_path / "run"
    _dist_ckpt(top / "iter_0000020")
    (top / "latest_checkpointed_iteration.txt").write_text("20\n")
    assert ld.weights_dir(top) == str(top / "iter_0000020")
    (top / "latest_checkpointed_iteration.txt").write_text("30\n")
    with pytest.raises(FileNotFoundError, match="iter_0000030"):
        ld.weights_dir(top)
    (top / "latest_checkpointed_iteration.txt").write_text("latest\n")
    with pytest.raises(ValueError, match="iteration number or 'release'"):
        ld.weights_dir(top)
    flat = _dist_ckpt(tmp_path / "flat")  # older converter output, weight-sync scratch dirs
    assert ld.weights_dir(flat) == str(flat)
    with pytest.raises(FileNotFoundError, match="no dist checkpoint here"):
        ld.weights_dir(tmp_path / "empty")
