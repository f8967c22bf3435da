"""Shared pytest set-up: markers (gpu, megatron, slow) and the gpu skip on CUDA-less machines."""

import importlib.util

import pytest
import torch


def pytest_configure(config):
    for line in (
        "gpu: needs a CUDA GPU (skipped without one)",
        "megatron: needs megatron-core",
        "slow: multi-process or end-to-end runs",
    ):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    skip_mcore = pytest.mark.skip(reason="megatron-core not installed")
    has_mcore = importlib.util.find_spec("megatron") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "megatron" in item.keywords and not has_mcore:
            item.add_marker(skip_mcore)


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234
