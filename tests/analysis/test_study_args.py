"""The mask study's arguments are a typed section: checked on construction like the run config's
sections (megatron_pdm/configtree.py), each bad value a ConfigError naming its key."""

from __future__ import annotations

import pytest

from megatron_pdm.analysis.study import StudyArgs
from megatron_pdm.configtree import ConfigError, from_mapping


@pytest.mark.parametrize("kw,key", [
    ({"batches": "stale"}, "batches='stale'"),
    ({"stats_dtype": "fp16"}, "stats_dtype='fp16'"),
    ({"adam_state": "zero"}, "adam_state='zero'"),
    ({"seeds": []}, "seeds"),
    ({"seeds": [1, 2.5]}, "seeds[1]=2.5"),
    ({"minibatch": -1}, "minibatch=-1"),
    ({"delta_kl": "wide"}, "delta_kl='wide'"),
    ({"plots": "yes"}, "plots='yes'"),
    ({"source": "engine"}, "source='engine'"),
    ({"stale_iterations": 0}, "stale_iterations=0"),
    ({"sgd_lr": 0.0}, "sgd_lr=0.0"),
    ({"design": "both"}, "design='both'"),
    ({"run_iterations": 0}, "run_iterations=0"),
])
def test_bad_value_names_its_key(kw, key):
    with pytest.raises(ConfigError) as err:
        StudyArgs(out_dir="/tmp/x", **kw)
    assert str(err.value).startswith(key), str(err.value)


def test_from_mapping_converts_and_refuses_unknown_keys():
    a = from_mapping(StudyArgs, {"out_dir": "o", "seeds": ["3", 4], "delta_kl": "0.1",
                                 "plots": "false", "batches": "saved"})
    assert (a.seeds, a.delta_kl, a.plots, a.batches) == ([3, 4], 0.1, False, "saved")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['seed'\]"):
        from_mapping(StudyArgs, {"out_dir": "o", "seed": 3})


def test_defaults_are_valid():
    a = StudyArgs(out_dir="o")
    assert a.batches == "fresh" and a.seeds == list(range(1, 21)) and a.stats_dtype == "fp64"
