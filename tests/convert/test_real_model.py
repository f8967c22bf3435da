"""The real model (SmolLM2-135M-Instruct, docs/real-model.md) through the converter at TP 3.

HF -> megatron TP 3 -> HF is bit-exact, and megatron's logits match transformers' within
verify_conversion's default thresholds on chat-template prompts of the model's own tokenizer.
TP 3, not 2: its 9 query / 3 key-value heads divide by 1 and 3 only. Skipped (with the reason)
when `make real-model` has not prepared the directory (a failure under `make test`, which
prepares it: tests/conftest.py `real_model_dir`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
REAL = Path(__file__).resolve().parents[2] / ".cache" / "real-model" / "smollm2-135m-instruct"


def _tool(name):
    return importlib.import_module(f"megatron_pdm.tools.{name}")


@pytest.fixture(scope="module")
def real_tp3(tmp_path_factory, real_model_dir):  # skips (or fails under make test) unprepared
    out = tmp_path_factory.mktemp("real") / "tp3"
    _tool("convert_hf_to_megatron").convert_hf_to_megatron(str(REAL), str(out), tp=3)
    return out


@pytest.mark.gloo
def test_real_model_round_trips_bit_exactly_at_tp3(real_tp3, tmp_path):
    _tool("convert_megatron_to_hf").convert_megatron_to_hf(str(real_tp3), str(tmp_path / "back"))
    src, dst = load_file(str(REAL / "model.safetensors")), {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        dst.update(load_file(str(f)))
    assert "lm_head.weight" not in src and src.keys() == dst.keys()
    for name in src:
        assert torch.equal(src[name], dst[name]), name
    assert (tmp_path / "back" / "config.json").read_text() and \
        (tmp_path / "back" / "tokenizer.json").is_file()


@pytest.mark.gloo
def test_real_model_logits_match_transformers_on_its_tokenizer(real_tp3):
    verify = _tool("verify_conversion")
    result = verify.verify_conversion(str(REAL), str(real_tp3), tp=3,
                                      prompts=list(verify.DEFAULT_PROMPTS), chat=True)
    print(f"real model TP3 vs transformers: {result}")
    assert result["prompts"] == "text (chat)" and result["tokens"] > 40
    # verify_conversion's default thresholds (its --max-dlogit / --max-kl)
    assert result["max_abs_dlogit"] <= 1e-3 and result["max_kl"] <= 1e-6, result
    assert result["argmax_agreement"] == 1.0


def test_real_model_import_at_tp2_is_refused_by_name(tmp_path, real_model_dir):
    """9 query / 3 key-value heads do not split over 2 ranks: refused before any rank starts."""
    with pytest.raises(ValueError, match="num_query_groups=3 is not divisible by TP=2"):
        _tool("convert_hf_to_megatron").convert_hf_to_megatron(str(REAL), str(tmp_path / "x"),
                                                               tp=2)
