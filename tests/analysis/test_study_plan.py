"""The study takes its minibatches and learning rates from the driver's own rules (train/schedule.py)."""

from __future__ import annotations

import torch

from megatron_pdm.analysis.study import study_step_lrs
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.schedule import dp_microbatches, minibatch_plan, rl_lr


def test_minibatch_plan_is_a_seeded_partition():
    plan = minibatch_plan(1234, 7, 50, 4)
    assert len(plan) == 4
    assert sorted(torch.cat(plan).tolist()) == list(range(50))
    assert all(torch.equal(a, b) for a, b in zip(plan, minibatch_plan(1234, 7, 50, 4)))
    assert not torch.equal(torch.cat(plan), torch.cat(minibatch_plan(1234, 8, 50, 4)))


def test_dp_microbatches_cover_the_minibatch_once_across_ranks():
    idx = torch.arange(10)
    got = [m for r in range(2) for m in dp_microbatches(idx, dp_size=2, dp_rank=r, microbatches=2)]
    assert sorted(torch.cat(got).tolist()) == list(range(10))


def test_study_lrs_follow_the_warmup_schedule():
    """The study used train.lr for every step; inside the warm-up the run's lr is smaller."""
    cfg = RunConfig.load(None, ["train.lr=1e-3", "train.lr_warmup_steps=10"])
    lrs = study_step_lrs(cfg.train, 2, 3)
    assert lrs == [rl_lr(cfg.train, s) for s in (2, 3, 4, 5)]
    assert lrs == [1e-3 * k / 10 for k in (3, 4, 5, 6)] and lrs[-1] < cfg.train.lr
    assert study_step_lrs(cfg.train, 50, 1) == [1e-3, 1e-3]


def test_each_source_has_its_study_minibatch():
    from megatron_pdm.analysis.sources import SOURCES, default_minibatch

    assert {s: default_minibatch(s, 4) for s in SOURCES} == {"drift": 3, "precision": 0,
                                                             "stale": 0}
