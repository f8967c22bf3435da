"""What a user finds after a run, and what a common mistake prints.

- One short 2-process run with TensorBoard, plot and progress on, stderr redirected (not a
  terminal): the resolved config is saved as `config.yaml` (with its digest line) and loads back
  to the same tree; the greedy evaluations and the warm-up's probes are TensorBoard scalars next
  to the per-step rows;
  the progress output has no carriage returns (tqdm's redraws flooded redirected logs) and ends
  with the last iteration.
- Mistakes without a traceback (exit status 2, one `error:` line): a Megatron-LM flag (`--tp 4`)
  names the `--set` key; a plain `python -m megatron_pdm.train` names the torchrun command;
  `log.wandb=true` without the wandb package names the extra.
- W&B in offline mode (only where the optional `wandb` extra is installed): the run writes an
  offline W&B run with the rows and evaluations.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.support._launch import CONFIG, ROOT, launch

OUTPUTS = ["log.tensorboard=true", "log.plot=true", "log.progress=true",
           "warmup.stop_at_accuracy=1.0", "warmup.check_every=5"]


@pytest.fixture(scope="module")
def outputs_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("outputs") / "run")
    proc = launch(out, OUTPUTS)
    return out, proc


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.slow
def test_resolved_config_is_saved_and_loads_back(outputs_run):
    from megatron_pdm.train.config import RunConfig

    out, _ = outputs_run
    saved = os.path.join(out, "config.yaml")
    assert os.path.exists(saved), "no config.yaml in the run directory"
    cfg = RunConfig.load(saved)
    assert cfg.output_dir == out and cfg.train.iterations == 4 and cfg.warmup.check_every == 5
    with open(saved) as f:
        assert f.readline().startswith("# written by megatron-pdm: sha256 ")  # configfile.py
        f.seek(0)
        assert RunConfig.from_dict(yaml.safe_load(f)).to_dict() == cfg.to_dict()


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.slow
def test_evaluations_are_in_tensorboard(outputs_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = outputs_run
    acc = EventAccumulator(os.path.join(out, "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("eval/greedy_acc_before_warmup", "eval/greedy_acc_before_rl",
                "eval/greedy_acc_after_rl", "warmup/probe_acc", "reward/mean"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("warmup/probe_acc")] == [5, 10]
    assert [e.step for e in acc.Scalars("eval/greedy_acc_after_rl")] == [8]  # last RL step
    assert os.path.exists(os.path.join(out, "plot.png"))


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.slow
def test_progress_suits_a_redirected_log(outputs_run):
    _, proc = outputs_run
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("RL ")]
    assert lines and lines[-1].startswith("RL 4/4 (100%) reward "), lines


def _cli(args: list[str], env_extra: dict | None = None, drop=("RANK", "WORLD_SIZE")):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "megatron_pdm.train", "--config", CONFIG, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def test_megatron_lm_flags_name_the_config_key():
    line = _one_error_line(_cli(["--tp", "4", "--lr=1e-5", "--bf16"]))
    assert "--set parallel.tp=4" in line and "--set train.lr=1e-5" in line, line
    assert "--set precision.params_dtype=bf16" in line, line


def test_plain_python_start_names_torchrun():
    line = _one_error_line(_cli(["--set", "parallel.tp=2"]))
    assert "torchrun --nproc-per-node 2 -m megatron_pdm.train" in line, line


def test_wandb_without_the_package_names_the_extra(tmp_path):
    # a `wandb` that cannot be imported, whether or not the real one is installed here
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("raise ImportError('No module named wandb')")
    env = {"PYTHONPATH": str(tmp_path) + os.pathsep + ROOT, "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29399"}
    line = _one_error_line(_cli(["--set", "log.wandb=true", "--set", "parallel.tp=1"], env,
                                drop=()))
    assert "megatron-pdm[wandb]" in line, line


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.slow
def test_wandb_offline_run(tmp_path):
    pytest.importorskip("wandb")
    out = str(tmp_path / "run")
    os.environ.setdefault("WANDB_MODE", "offline")
    launch(out, ["log.wandb=true", "log.wandb_project=pdm-test", "train.iterations=2"])
    runs = [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1, os.listdir(os.path.join(out, "wandb"))
    run_dir = os.path.join(out, "wandb", runs[0])
    records = [f for f in os.listdir(run_dir) if f.endswith(".wandb")]
    assert len(records) == 1
    with open(os.path.join(out, "wandb_id")) as f:
        assert f.read().strip() in runs[0]
    with open(os.path.join(run_dir, records[0]), "rb") as f:
        data = f.read()  # protobuf records: metric names are stored as plain strings
    for key in (b"reward/mean", b"grad_norm", b"eval/greedy_acc_before_rl",
                b"eval/greedy_acc_after_rl", b"pdm-test"):
        assert key in data, key
