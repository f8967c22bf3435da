"""`python -m megatron_pdm.train --help` lists every config key by section, read from the config
dataclasses, so a new key (e.g. rollout.vllm.pause_wait_s) shows up without editing the help."""

from __future__ import annotations

import re

import pytest

from megatron_pdm.train.__main__ import config_keys_help, parse_args
from megatron_pdm.train.config import RunConfig


def _leaves(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def _help_keys(text: str) -> set[str]:
    body = " ".join(line.strip() for line in text.splitlines()[1:])
    keys = set()
    for section, names in re.findall(r"([\w.]+\.)\{([^}]*)\}", body):
        keys |= {section + n.strip() for n in names.split(",")}
    top = re.sub(r"[\w.]+\.\{[^}]*\}", "", body)
    keys |= {n.strip() for n in top.split(",") if n.strip()}
    return keys


def test_help_lists_every_key_of_the_resolved_config():
    keys = _help_keys(config_keys_help())
    saved = _leaves(RunConfig().to_dict())  # what `config.yaml` holds: every key, resolved
    assert saved <= keys, sorted(saved - keys)
    assert keys - saved == {"loss.name"}  # accepted, informational; written as loss.preset
    assert "rollout.vllm.pause_wait_s" in keys


def test_help_prints_the_keys(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "config keys (--set KEY=VALUE" in out
    # the printed text (argparse may wrap lines) names every key of the resolved config
    assert _leaves(RunConfig().to_dict()) <= _help_keys(out.split("config keys", 1)[1])
