"""vllm_server: serving an existing HF directory (--model-dir), relative paths, KV cache size."""

from __future__ import annotations

import pytest

from megatron_pdm.train.rollout.vllm_server.cli import main
from megatron_pdm.train.rollout.vllm_server.process import VLLMServer
from megatron_pdm.train.rollout.vllm_server.venv import ROOT


def test_relative_model_dir_is_resolved_and_kv_cache_passed(tmp_path, monkeypatch):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"max_position_embeddings": 128}')
    monkeypatch.chdir(tmp_path)
    server = VLLMServer("hf", tmp_path / "work", api_key="k" * 32, kv_cache_bytes=512 << 20)
    assert server.model_dir == (tmp_path / "hf").resolve() and server.max_model_len == 128
    cmd = server.command()
    assert cmd[cmd.index("--model") + 1] == str((tmp_path / "hf").resolve())
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(512 << 20)


def test_model_dir_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="--model-dir .*no config.json"):
        main(["--config", str(ROOT / "examples" / "tiny_cpu" / "config.yaml"), "--model-dir", str(tmp_path),
              "--workdir", str(tmp_path / "w")])
