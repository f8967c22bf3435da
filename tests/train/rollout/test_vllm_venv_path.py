"""Where the driver looks for the vLLM environment: VLLM_VENV, else <repo>/.venv-vllm in a source
checkout, else ./.venv-vllm (an installed wheel: never a path inside site-packages)."""

from __future__ import annotations

from pathlib import Path

from megatron_pdm.train.rollout.vllm_server import venv as vllm_server


def test_env_var_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "v"))
    assert vllm_server.vllm_python() == tmp_path / "v" / "bin" / "python"
    assert vllm_server.vllm_python(tmp_path / "w") == tmp_path / "w" / "bin" / "python"


def test_checkout_default_is_the_repo(monkeypatch):
    monkeypatch.delenv("VLLM_VENV", raising=False)
    assert vllm_server.vllm_python() == vllm_server.ROOT / ".venv-vllm" / "bin" / "python"


def test_installed_default_is_the_working_directory(monkeypatch, tmp_path):
    site = tmp_path / "lib" / "python3.12" / "site-packages"  # an installed wheel's root
    (site / "megatron_pdm").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    got = vllm_server.default_venv(site)
    assert got == Path(tmp_path) / ".venv-vllm" and "site-packages" not in str(got)
