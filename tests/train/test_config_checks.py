"""Config values and combinations refused before any process group forms (train/config.py), and
the CLI's one-line error printed by every rank (cli.run_cli)."""

from __future__ import annotations

import pytest

from megatron_pdm.cli import run_cli
from megatron_pdm.configtree import ConfigError
from megatron_pdm.train.config import RunConfig, check_world


@pytest.mark.parametrize("item,match", [
    ("train.lr=inf", "train.lr=inf must be a finite"),
    ("rollout.temperature=inf", "rollout.temperature=inf must be a finite"),
    ("warmup.lr=inf", "warmup.lr=inf must be a finite"),
    ("train.clip_grad=inf", "train.clip_grad=inf must be"),
    ("rollout.timeout_s=inf", "rollout.timeout_s=inf must be a finite"),
])
def test_non_finite_values_are_refused(item, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.load(None, [item])


def test_fewer_samples_than_minibatches_is_refused():
    with pytest.raises(ConfigError, match="minibatches_per_iteration=4 exceeds the 2 samples"):
        RunConfig.load(None, ["rollout.prompts_per_iteration=1", "rollout.group_size=2",
                              "train.minibatches_per_iteration=4"])


def test_dp_with_fewer_samples_per_minibatch_than_ranks_is_refused():
    cfg = RunConfig.load(None, ["parallel.tp=1", "parallel.ep=2", "rollout.prompts_per_iteration=1",
                                "rollout.group_size=4", "train.minibatches_per_iteration=4"])
    with pytest.raises(ConfigError, match="1 samples per minibatch .* fewer than the 2"):
        check_world(cfg, 2)


def test_layout_that_does_not_fit_the_world_is_refused():
    cfg = RunConfig.load(None, ["parallel.tp=3"])
    with pytest.raises(ConfigError, match="parallel.tp=3 .* WORLD_SIZE=2"):
        check_world(cfg, 2)
    check_world(RunConfig.load(None, ["parallel.tp=2"]), 2)


def test_duplicate_yaml_key_is_refused_with_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.001\n  iterations: 3\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"{path}:4: key 'lr' given twice \(first on line 2\)"):
        RunConfig.load(str(path))


def test_every_rank_prints_its_own_error_line(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def main(argv):
        raise ConfigError("train.lr=inf must be a finite number")

    assert run_cli(main) == 2
    assert capsys.readouterr().err == "[rank 1] error: train.lr=inf must be a finite number\n"


def test_max_position_embeddings_shorter_than_the_task_is_refused():
    cfg = RunConfig.load(None, ["model.max_position_embeddings=8", "task.num_digits=4"])
    with pytest.raises(ConfigError, match="max_position_embeddings=8 is shorter than the task"):
        check_world(cfg, 2)
    cfg = RunConfig.load(None, ["model.max_position_embeddings=64",
                                "rollout.max_sequence_length=128"])
    with pytest.raises(ConfigError, match="128-token"):
        check_world(cfg, 2)
