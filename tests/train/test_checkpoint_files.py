"""Checkpoint file rules (mcore/ckpt_files.py) and the driver's resume rules (train/resume.py),
on fake checkpoint directories: no torch.distributed, no megatron."""

from __future__ import annotations

import os

import pytest

from megatron_pdm.configtree import ConfigError
from megatron_pdm.mcore import ckpt_files as F
from megatron_pdm.train import resume as R
from megatron_pdm.train.config import RunConfig


def _save(save_dir, iteration, *, run_id="new", keep_last=2, identity=None, payload=b"x" * 4096,
          hook=None):
    """What save_checkpoint does on rank 0, with one fake shard instead of megatron's files."""
    tmp = F.prepare_tmp(str(save_dir), iteration)
    with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
        f.write(payload)
    F.write_manifest(tmp, run_id=run_id, iteration=iteration, identity=identity or {})
    return F.publish(str(save_dir), iteration, tmp, run_id=run_id, keep_last=keep_last,
                     hook=hook)


def _names(save_dir):
    return sorted(n for n in os.listdir(save_dir) if n.startswith("iter_"))


def test_rotation_by_iteration_of_this_run_keeps_new_checkpoints(tmp_path):
    # an older, longer run left iter_4 and iter_5 (they sort after the new run's iter_1)
    for it in (4, 5):
        _save(tmp_path, it, run_id="old")
    for it in (0, 1, 2):
        _save(tmp_path, it, run_id="new", keep_last=2)
        assert (tmp_path / F.ckpt_name(it)).is_dir()  # never deletes the one just written
    assert _names(tmp_path) == ["iter_0000001", "iter_0000002", "iter_0000004",
                                "iter_0000005"]
    assert F.read_latest(str(tmp_path)) == "iter_0000002"


def test_latest_naming_a_missing_directory_resumes_from_newest_complete(tmp_path, caplog):
    for it in (2, 3):
        _save(tmp_path, it, keep_last=0)
    (tmp_path / "latest").write_text("iter_0000009")
    assert F.find_resume(str(tmp_path)) == str(tmp_path / "iter_0000003")
    assert "iter_0000009" in caplog.text


def test_incomplete_save_is_never_resumed(tmp_path):
    _save(tmp_path, 1)
    tmp = F.prepare_tmp(str(tmp_path), 2)  # killed while writing iteration 2
    (open(os.path.join(tmp, "__0_0.distcp"), "wb")).close()
    assert F.find_resume(str(tmp_path)) == str(tmp_path / "iter_0000001")


@pytest.mark.parametrize("phase", ["moved_aside", "renamed", "latest"])
def test_resave_of_latest_killed_at_each_phase_is_recoverable(tmp_path, phase):
    _save(tmp_path, 3, payload=b"a" * 4096)

    class Killed(Exception):
        pass

    def hook(name):
        if name == phase:
            raise Killed(name)

    with pytest.raises(Killed):
        _save(tmp_path, 3, payload=b"b" * 4096, hook=hook)
    path = F.find_resume(str(tmp_path))  # verified: a complete copy of iteration 3
    assert path is not None and os.path.basename(path).startswith("iter_0000003")
    _save(tmp_path, 3, payload=b"c" * 4096)  # the next re-save cleans up
    assert _names(tmp_path) == ["iter_0000003"]
    assert F.find_resume(str(tmp_path)) == str(tmp_path / "iter_0000003")


@pytest.mark.parametrize("damage", ["zeros", "random"])
def test_corruption_is_caught_before_load_naming_the_file(tmp_path, damage):
    path = _save(tmp_path, 1, payload=bytes(range(256)) * 64)
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(512)
        f.write(b"\0" * 256 if damage == "zeros" else os.urandom(4096))
    with pytest.raises(F.CheckpointError, match="__0_0.distcp"):
        F.find_resume(str(tmp_path))


def test_latest_outside_the_run_directory_is_refused(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "latest").write_text("../../x")
    with pytest.raises(F.CheckpointError, match=r"\.\./\.\./x"):
        F.find_resume(str(tmp_path))


def _cfg(tmp_path, *sets):
    return RunConfig.load(None, [f"output_dir={tmp_path}", *sets])


def _saved_run(tmp_path, *sets, world=2):
    cfg = _cfg(tmp_path, *sets)
    _save(R.checkpoint_dir(cfg), 2, identity=R.identity(cfg, world))
    return cfg


def test_resume_with_a_changed_task_names_the_key(tmp_path):
    _saved_run(tmp_path)
    cfg = _cfg(tmp_path, "task.num_digits=3")
    with pytest.raises(ConfigError, match="task.num_digits: checkpoint 2, this run 3"):
        R.check_before_start(cfg, resume=True, world_size=2)
    R.check_before_start(_cfg(tmp_path), resume=True, world_size=2)  # unchanged: fine


def test_resume_with_another_distributed_optimizer_layout_names_the_keys(tmp_path):
    _saved_run(tmp_path, "parallel.tp=2", "parallel.ep=1")
    cfg = _cfg(tmp_path, "parallel.tp=1", "parallel.ep=2")
    with pytest.raises(ConfigError, match="parallel.ep.*parallel.tp"):
        R.check_before_start(cfg, resume=True, world_size=2)


def test_fresh_start_over_checkpoints_is_refused_unless_allowed(tmp_path):
    _saved_run(tmp_path)
    with pytest.raises(ConfigError, match="checkpoint.allow_fresh_start"):
        R.check_before_start(_cfg(tmp_path), resume=False, world_size=2)
    cfg = _cfg(tmp_path, "checkpoint.allow_fresh_start=true")
    R.check_before_start(cfg, resume=False, world_size=2)
    moved = R.move_aside(cfg)
    assert moved == os.path.abspath(cfg.output_dir) + ".old-1" and os.path.isdir(
        os.path.join(moved, "checkpoints", "iter_0000002"))  # nothing deleted
    assert not F.has_checkpoints(R.checkpoint_dir(cfg)) and os.path.isdir(cfg.output_dir)
    _saved_run(tmp_path)  # a second fresh start finds the next free name
    assert R.move_aside(cfg) == os.path.abspath(cfg.output_dir) + ".old-2"


def test_resume_where_latest_names_nothing_and_no_checkpoint_fails(tmp_path):
    cfg = _cfg(tmp_path)
    os.makedirs(R.checkpoint_dir(cfg))
    with open(os.path.join(R.checkpoint_dir(cfg), "latest"), "w") as f:
        f.write("iter_0000003")
    with pytest.raises(ConfigError, match="missing"):
        R.check_before_start(cfg, resume=True, world_size=2)
