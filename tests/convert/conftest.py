"""A tiny random Qwen3-MoE saved by transformers (config only, no hub), in both expert layouts."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_pdm.convert.tiny import TINY_CONFIG as TINY  # noqa: F401 - used by the tests
from megatron_pdm.convert.tiny import make_tiny_hf


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(per-expert dir as written by save_pretrained, fused-layout dir, the in-memory model)."""
    root = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model = make_tiny_hf(root / "hf")
    make_tiny_hf(root / "hf_fused", expert_layout="fused")  # transformers' in-memory layout
    return root / "hf", root / "hf_fused", model
