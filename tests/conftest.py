"""Shared pytest set-up: markers (gpu, megatron, slow) and the gpu skip on CUDA-less machines."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
# the repository (the package without an editable install; `tests.support...`) and the shared
# helpers (tests/support: the fake servers and their parts, imported by their file names as the
# helper processes started from there do)
for _p in (str(_ROOT), str(_ROOT / "tests" / "support")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Session-wide harnesses, each with its marker and fixtures: the real vLLM server (marker vllm,
# fixture vllm_server), the sglang API boxes (marker sglang_api, fixtures version/box/report),
# the verl env (marker verl).
pytest_plugins = ["tests.support.vllm_server", "tests.support.sglang_api", "tests.support.verl_env"]


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


REAL_MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache/real-model/smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The prepared real model (SmolLM2-135M-Instruct as an HF directory: `make real-model`).

    Skips where it was not prepared; `make test` prepares it first and sets
    PDM_REQUIRE_REAL_MODEL=1, which turns that skip into a failure.
    """
    if (REAL_MODEL_DIR / "prepared.json").is_file():
        return REAL_MODEL_DIR
    problem = f"the real model is not prepared at {REAL_MODEL_DIR} (run `make real-model`)"
    if os.environ.get("PDM_REQUIRE_REAL_MODEL") == "1":
        raise pytest.UsageError(f"PDM_REQUIRE_REAL_MODEL=1 but {problem}")
    pytest.skip(problem)
