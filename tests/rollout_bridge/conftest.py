"""Fixtures for the rollout-bridge tests: a tiny causal LM, engines and the fake SGLang server."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _ROOT not in sys.path:  # the package is importable without an (editable) install too
    sys.path.insert(0, _ROOT)

from fake_sglang import FakeSGLangServer  # noqa: E402

from rollout_bridge import LocalEngine  # noqa: E402
from tiny_lm import VOCAB, TinyLM  # noqa: E402


@pytest.fixture
def tiny_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


@pytest.fixture
def local_engine(tiny_model) -> LocalEngine:
    return LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=5, seed=0, eos_token_id=3)


@pytest.fixture
def server(tiny_model):
    srv = FakeSGLangServer(LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=5, seed=1,
                                       eos_token_id=3))
    srv.start()
    yield srv
    srv.stop()
