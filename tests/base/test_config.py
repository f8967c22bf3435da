"""Configs: presets carry the papers' defaults; one typed parser for the loss and the run config.

The run-config cases are the bugs of the two-parser design: `--set loss.noise_floor=1e-3` and
`loss.ratio_cap=inf` through the driver, a misspelt `loss.*` key, the loss section as an untyped
dict, enum values checked in a central table, and CLI errors printed with a traceback.
"""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_pdm.arch import ModelArch
from megatron_pdm.config import PRESETS, PolicyLossConfig
from megatron_pdm.configtree import ConfigError, convert, from_mapping
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_cpu" / "config.yaml"


def test_preset_defaults():
    g = PolicyLossConfig.preset("grpo")
    assert (g.proximity, g.direction, g.delta_low, g.delta_high) == ("ratio", "ratio", 0.2, 0.28)
    assert PolicyLossConfig.preset("dppo-binary-tv").delta_high == 0.15
    assert PolicyLossConfig.preset("dppo-binary-kl").delta_high == 0.05
    assert PolicyLossConfig.preset("dppo-topk-tv").delta_high == 0.2
    assert PolicyLossConfig.preset("dppo-topk-kl").delta_high == 0.05
    for name, tail in (("pdm-agg", "aggregated"), ("pdm-uniform", "uniform"),
                       ("pdm-exact", "exact")):
        c = PolicyLossConfig.preset(name)
        assert (c.proximity, c.direction, c.tail, c.delta_high, c.ratio_cap) == (
            "topk_kl", "predictive", tail, 0.15, 5.0)
        assert c.name == name
    t = PolicyLossConfig.preset("pdm-tv")
    assert (t.proximity, t.tail, t.delta_high) == ("topk_tv", "exact", 0.2)
    d = PolicyLossConfig.preset("drpo")
    assert (d.shaping, d.delta_high, d.ratio_cap) == ("drpo", 12.5, math.inf)
    nt = PolicyLossConfig.preset("is-pg")          # the stability benchmark's no-trust-region row
    assert nt.name == "is-pg"
    ice = PolicyLossConfig.preset("icepop")        # §10 corrections, verl 0.9.1's bounds
    assert (ice.is_mask, ice.is_mask_low, ice.is_mask_high) == ("token", 0.5, 5.0)
    geo = PolicyLossConfig.preset("geo-rs")
    assert (geo.is_mask, geo.seq_ratio, geo.is_mask_low, geo.is_mask_high) == (
        "sequence", "geometric", 0.999, 1.001)
    assert len(PRESETS) == 14


@pytest.mark.parametrize("kwargs,match", [
    (dict(proximity="l2"), r"proximity='l2': expected one of \['ratio'"),
    (dict(proximity="ratio", direction="predictive"), "needs a divergence proximity"),
    (dict(delta_low=0.0), "delta_low must be > 0"),
    (dict(aggregation="seq-mean-token-sum-norm"), "loss_horizon"),
    (dict(direction="ratio", noise_floor=1e-3), "noise_floor"),
    (dict(shaping="drpo", proximity="none", direction="ratio"), "drpo"),
    (dict(delta_high="big"), "delta_high='big': expected a number"),
])
def test_the_section_validates_its_own_values(kwargs, match):
    # Built directly in Python, without the parser: the dataclass itself refuses.
    with pytest.raises(ConfigError, match=match):
        PolicyLossConfig(**kwargs)


def test_values_are_converted_by_field_type():
    c = PolicyLossConfig.from_dict({"preset": "pdm-agg", "noise_floor": "1e-3",
                                    "ratio_cap": "inf", "loss_horizon": "8192"})
    assert c.noise_floor == 1e-3 and c.ratio_cap == math.inf and c.loss_horizon == 8192
    assert PolicyLossConfig(ratio_cap="inf").ratio_cap == math.inf  # direct construction too
    assert convert("null", float | None, "k") is None
    for value, tp in ((8.5, int), (True, int), ("x", float), (1, bool), ("nan", float)):
        with pytest.raises(ConfigError, match="k="):
            convert(value, tp, "k")


def test_yaml_roundtrip_and_unknown_keys(tmp_path):
    cfg = PolicyLossConfig.preset("drpo")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert PolicyLossConfig.from_yaml(path) == cfg
    path.write_text("preset: pdm-exact\ndelta_high: 0.2\n")
    c = PolicyLossConfig.from_yaml(path)
    assert (c.tail, c.delta_high, c.delta_low) == ("exact", 0.2, 0.15)
    path.write_text("preset: pdm-agg\ndelta_hihg: 0.2\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['delta_hihg'\]; valid keys .*"
                                          r"'delta_high'.*'preset'"):
        PolicyLossConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="unknown key"):
        cfg.with_overrides({"policy_loss.nope": 1})
    assert cfg.with_overrides(["policy_loss.delta_high=0.5"]).delta_high == 0.5
    assert cfg.with_overrides(["loss.noise_floor=null"]).noise_floor is None


def test_shipped_yaml_presets_load():
    import megatron_pdm

    files = sorted((Path(megatron_pdm.__file__).parent / "configs").glob("*.yaml"))
    assert files
    for f in files:
        PolicyLossConfig.from_yaml(f)


def test_run_config_loss_section_is_typed_and_overridable():
    cfg = RunConfig.load(str(TINY), ["loss.noise_floor=1e-3", "loss.ratio_cap=inf"])
    assert isinstance(cfg.loss, PolicyLossConfig)
    assert cfg.loss.noise_floor == 1e-3 and cfg.loss.ratio_cap == math.inf
    assert cfg.loss.name == "pdm-agg"
    cfg = RunConfig.load(str(TINY), ["loss.preset=grpo", "loss.delta_high=0.3"])
    assert (cfg.loss.name, cfg.loss.proximity, cfg.loss.delta_high) == ("grpo", "ratio", 0.3)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['loss.delta_hihg'\]; valid keys "
                                          r"of loss: \[.*'delta_high'"):
        RunConfig.load(str(TINY), ["loss.delta_hihg=0.3"])
    with pytest.raises(ConfigError, match="loss.preset='pdm-x': unknown preset"):
        RunConfig.load(str(TINY), ["loss.preset=pdm-x"])


def test_model_section_is_the_architecture_dataclass():
    cfg = RunConfig.load(str(TINY))
    assert type(cfg.model) is ModelArch
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['model.hiden_size'\]"):
        RunConfig.load(str(TINY), ["model.hiden_size=32"])
    with pytest.raises(ConfigError, match="model.head_dim=16.5: expected an integer"):
        RunConfig.load(str(TINY), ["model.head_dim=16.5"])


def test_enum_values_belong_to_their_section():
    with pytest.raises(ConfigError, match=r"engine='vlm': expected one of"):
        RolloutConfig(engine="vlm")
    with pytest.raises(ConfigError, match=r"rollout.engine='vlm': expected one of"):
        RunConfig.load(str(TINY), ["rollout.engine=vlm"])
    with pytest.raises(ConfigError, match="rollout.engine=sglang needs rollout.sglang.url"):
        RunConfig.load(str(TINY), ["rollout.engine=sglang", "rollout.sglang.hf_checkpoint=/x"])


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = RunConfig.load(str(TINY), ["loss.preset=drpo", "train.lr=1e-4"])
    cfg.save(tmp_path / "resolved.yaml")
    again = RunConfig.load(str(tmp_path / "resolved.yaml"))
    assert again == cfg and again.loss.ratio_cap == math.inf


@dataclasses.dataclass
class Inner:
    depth: int = 0


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    width: int = 1


def test_unknown_key_error_guesses_its_place():
    """configtree, for any schema: a key that exists in a nested section is pointed there, a
    misspelt one gets the closest valid keys, and a key like neither gets no guess."""
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['top\.depth'\]; valid keys of "
                                          r"top: \['inner', 'width'\]; top\.depth: did you mean "
                                          r"top\.inner\.depth\?$"):
        from_mapping(Outer, {"depth": 2}, "top")
    with pytest.raises(ConfigError, match=r"top\.widht: did you mean top\.width\?$"):
        from_mapping(Outer, {"widht": 2}, "top")
    with pytest.raises(ConfigError, match=r"valid keys of top: \['inner', 'width'\]$"):
        from_mapping(Outer, {"colour": 2}, "top")
    # the run config: an engine's key given at the top of `rollout`, a misspelt section name
    with pytest.raises(ConfigError, match=r"did you mean rollout\.local\.staleness\?$"):
        RunConfig.load(str(TINY), ["rollout.staleness=2"])
    with pytest.raises(ConfigError, match=r"rollot: did you mean rollout\?$"):
        RunConfig.load(str(TINY), ["rollot.engine=local"])


def test_from_mapping_reports_nested_paths():
    with pytest.raises(ConfigError, match="parallel: expected a mapping"):
        from_mapping(RunConfig, {"parallel": 3})


def test_cli_prints_config_errors_as_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_pdm.train", "--config", str(TINY), "--dry-run",
         "--set", "loss.noise_flor=1e-3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "loss.noise_flor" in lines[0] and "noise_floor" in lines[0]


def test_rl_learning_rate_warmup_schedule():
    from megatron_pdm.train.config import TrainConfig
    from megatron_pdm.train.schedule import rl_lr

    t = TrainConfig(lr=1e-3, lr_warmup_steps=4)
    assert [rl_lr(t, k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3,
                                                            1e-3])
    assert rl_lr(TrainConfig(lr=1e-3), 0) == 1e-3  # 0 = constant
    with pytest.raises(ConfigError, match="train.lr_warmup_steps"):
        TrainConfig(lr_warmup_steps=-1)
