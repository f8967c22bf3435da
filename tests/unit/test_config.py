"""PolicyLossConfig: presets carry the papers' defaults, validation, yaml and overrides."""

import math

import pytest

from megatron_pdm import PRESETS, PolicyLossConfig


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
    t = PolicyLossConfig.preset("pdm-tv")
    assert (t.proximity, t.tail, t.delta_high) == ("topk_tv", "exact", 0.2)
    d = PolicyLossConfig.preset("drpo")
    assert (d.shaping, d.delta_high, d.ratio_cap) == ("drpo", 12.5, math.inf)
    assert len(PRESETS) == 10


@pytest.mark.parametrize("kwargs,match", [
    (dict(proximity="l2"), "proximity must be one of"),
    (dict(proximity="ratio", direction="predictive"), "needs a divergence proximity"),
    (dict(delta_low=0.0), "delta_low must be > 0"),
    (dict(aggregation="seq-mean-token-sum-norm"), "loss_horizon"),
    (dict(direction="ratio", noise_floor=1e-3), "noise_floor"),
    (dict(shaping="drpo", proximity="none", direction="ratio"), "drpo"),
])
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_yaml_roundtrip_and_unknown_keys(tmp_path):
    import yaml

    cfg = PolicyLossConfig.preset("drpo")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert PolicyLossConfig.from_yaml(path) == cfg
    path.write_text("preset: pdm-exact\ndelta_high: 0.2\n")
    c = PolicyLossConfig.from_yaml(path)
    assert (c.tail, c.delta_high, c.delta_low) == ("exact", 0.2, 0.15)
    path.write_text("preset: pdm-agg\ndelta_hihg: 0.2\n")
    with pytest.raises(ValueError, match="unknown PolicyLossConfig keys"):
        PolicyLossConfig.from_yaml(path)
    with pytest.raises(ValueError, match="unknown PolicyLossConfig key"):
        cfg.with_overrides({"policy_loss.nope": 1})
    assert cfg.with_overrides(["policy_loss.delta_high=0.5"]).delta_high == 0.5


def test_shipped_yaml_presets_load():
    from pathlib import Path

    import megatron_pdm

    files = sorted((Path(megatron_pdm.__file__).parent / "configs").glob("*.yaml"))
    assert files
    for f in files:
        PolicyLossConfig.from_yaml(f)
