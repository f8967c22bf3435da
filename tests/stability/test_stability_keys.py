"""The benchmark's stress keys do what their docstrings say (measured on the objects that run).

rollout.local.staleness: the local rollout's weight queue loads the policy k versions behind and
the evaluation block sees the newest; train.epochs_per_batch: fresh permutations per epoch, epoch 0
unchanged; the is-pg preset masks nothing and keeps the raw importance weight.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_pdm.configtree import ConfigError
from megatron_pdm.train import schedule as sched
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.rollout.local import LocalRollout, latest_weights


class _Engine:
    def __init__(self):
        self.loaded: list[tuple[str, float]] = []

    def update_weights(self, weights, version):
        self.loaded.append((version, float(weights["gpt.w"][0])))


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))


@pytest.mark.parametrize("k", [0, 1, 2, 8])
def test_staleness_queue_serves_version_k_behind(k):
    policy, engine = _Policy(), _Engine()
    ro = LocalRollout(engine, lambda: policy, staleness=k)
    ro.sync("0")
    ro.sync("0")  # the driver re-pushes version 0 after the warm-up
    for v in range(1, 12):
        with torch.no_grad():
            policy.w.fill_(float(v))  # the trainer's weights of version v
        ro.sync(str(v))
        version, value = engine.loaded[-1]
        assert int(version) == max(0, v - k)  # staleness min(v, k)
        assert value == float(max(0, v - k))  # the copy really is the old weights
    with latest_weights(ro):
        assert engine.loaded[-1] == ("11", 11.0)
    assert engine.loaded[-1] == (str(11 - k), float(11 - k))


def test_staleness_copies_are_not_views():
    policy, engine = _Policy(), _Engine()
    ro = LocalRollout(engine, lambda: policy, staleness=2)
    ro.sync("0")
    with torch.no_grad():
        policy.w.fill_(5.0)  # an in-place optimizer step must not change the queued copy
    ro.sync("1")
    assert engine.loaded[-1] == ("0", 0.0)


def test_staleness_refuses_resume():
    ro = LocalRollout(_Engine(), lambda: _Policy(), staleness=1)
    with pytest.raises(ValueError, match=r"rollout\.local\.staleness=1"):
        ro.load_state_dict({})


def test_epochs_reshuffle_and_keep_epoch0():
    base = sched.minibatch_plan(7, 3, 32, 4)
    e0 = sched.minibatch_plan(7, 3, 32, 4, epoch=0)
    e1 = sched.minibatch_plan(7, 3, 32, 4, epoch=1)
    assert all(torch.equal(a, b) for a, b in zip(base, e0))
    assert sorted(torch.cat(e1).tolist()) == list(range(32))
    assert not torch.equal(torch.cat(e0), torch.cat(e1))


def test_config_keys_checked():
    cfg = RunConfig.load(None, ["train.epochs_per_batch=4", "rollout.local.staleness=8"])
    assert cfg.train.epochs_per_batch == 4 and cfg.rollout.local.staleness == 8
    with pytest.raises(ConfigError, match="epochs_per_batch"):
        RunConfig.load(None, ["train.epochs_per_batch=0"])
    with pytest.raises(ConfigError, match="staleness"):
        RunConfig.load(None, ["rollout.local.staleness=-1"])
    with pytest.raises(ConfigError, match="rollout.engine=local"):
        RunConfig.load(None, ["rollout.local.staleness=2", "rollout.engine=vllm",
                              "rollout.vllm.url=http://127.0.0.1:1"])


def test_is_pg_preset_has_no_trust_region():
    from megatron_pdm.config import PolicyLossConfig

    cfg = PolicyLossConfig.preset("is-pg")
    assert cfg.proximity == "none" and cfg.shaping == "mask" and math.isinf(cfg.ratio_cap)


def test_vllm_setting_runs_inside_its_server_launcher():
    # the engine-vllm-bf16 setting: the driver run is wrapped by vllm_server (bf16 server, the
    # cell's seed), the driver's keys select the vLLM engine at the URL the launcher fills in,
    # and every config key the setting sets is a real driver key; no other setting is wrapped
    from megatron_pdm.stability.grid import DEFAULT_SETTINGS, SETTINGS, Cell, Grid

    grid = Grid(["pdm-agg"], ["engine-vllm-bf16", "base"], [3])
    cell = Cell("pdm-agg", "engine-vllm-bf16", 3)
    prefix = grid.launcher(cell, "cfg.yaml")
    assert prefix[1:3] == ["-m", "megatron_pdm.train.rollout.vllm_server"] and prefix[-1] == "--"
    assert prefix[prefix.index("--dtype") + 1] == "bfloat16"
    assert prefix[prefix.index("--set") + 1] == "seed=3"
    assert grid.launcher(Cell("pdm-agg", "base", 3), "cfg.yaml") == []
    overrides = [o.replace("{vllm_url}", "http://127.0.0.1:1") for o in grid.overrides(cell)]
    cfg = RunConfig.load(None, overrides)
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.url == "http://127.0.0.1:1"
    assert "engine-vllm-bf16" not in DEFAULT_SETTINGS and "engine-vllm-bf16" in SETTINGS
