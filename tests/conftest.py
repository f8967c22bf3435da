"""Shared pytest set-up: markers, the gpu/megatron skips, the real model and the session harnesses.

tests/ mirrors the packages (docs/testing.md); what a test needs is a marker and a fixture:
gpu, megatron, slow, gloo (markers only), real_model (fixture real_model_dir, below),
vllm_server (fixture vllm_server: tests/support/vllm_server.py; vllm_venv, a marker only, for
a test that runs the vLLM venv's interpreter itself), sglang_api (fixtures version,
box, report: tests/support/sglang_api.py), verl (tests/support/verl_env.py). A test that asks
for one of these fixtures gets its marker here, so `-m` selects it either way.
"""

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
        "gloo: starts multi-process gloo workers",
        "real_model: needs the prepared real model (fixture real_model_dir)",
    ):
        config.addinivalue_line("markers", line)


# fixture -> the marker it implies (marked before the plugins' hooks and `-m` see the items)
FIXTURE_MARKERS = {"real_model_dir": "real_model", "vllm_server": "vllm_server",
                   "box": "sglang_api"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()) and \
                    item.get_closest_marker(marker) is None:
                item.add_marker(getattr(pytest.mark, marker))
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
