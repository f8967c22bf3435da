"""Dense families through the converter: a tiny random Llama (tied embeddings, no q/k norm) and a
tiny random dense Qwen3 (untied, q/k norm), `convert/tiny.py`.

HF -> megatron at TP 2 -> HF is bit-exact and megatron's logits match transformers'; Llama also
at PP 2 (the tied output layer of the last stage is the embedding's copy); the live export
(weight sync) of a loaded model gives back every HF tensor, also when the TP-2 checkpoint is
loaded at PP 2 (the dist checkpoint stores the tied weight once).
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_pdm.convert.tiny import make_tiny_dense_hf
from tests.support._dist import run_gloo, run_tool

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
FAMILIES = ("llama", "qwen3")


def _tool(name):
    return importlib.import_module(f"megatron_pdm.tools.{name}")


def _tensors(d) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """family -> (HF dir, megatron dir imported at TP 2)."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(f"dense_{family}")
        make_tiny_dense_hf(root / "hf", family)
        # on the session's gloo workers (the tool's own spawn: tests/convert/test_round_trip.py)
        run_tool(_tool("convert_hf_to_megatron").convert_hf_to_megatron, 2,
                 str(root / "hf"), str(root / "tp2"), tp=2)
        out[family] = (root / "hf", root / "tp2")
    return out


@pytest.mark.gloo
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_round_trip_is_bit_exact_and_logits_match(dense, family, tmp_path):
    hf_dir, mcore = dense[family]
    meta = json.loads((mcore / "pdm_model.json").read_text())
    assert meta["arch"]["num_experts"] == 0
    assert meta["arch"]["tie_word_embeddings"] is (family == "llama")
    assert meta["arch"]["qk_layernorm"] is (family == "qwen3")
    _tool("convert_megatron_to_hf").convert_megatron_to_hf(str(mcore), str(tmp_path / "back"))
    src, dst = _tensors(hf_dir), _tensors(tmp_path / "back")
    assert ("lm_head.weight" in src) is (family == "qwen3")  # tied: no lm_head in HF
    assert src.keys() == dst.keys()
    for name in src:
        assert torch.equal(src[name], dst[name]), name
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == family
    # on the pooled ranks: the in-group path a torchrun launch takes (rank 0 reports)
    result = run_tool(_tool("verify_conversion").verify_conversion, 2,
                      str(hf_dir), str(mcore), tp=2, num_prompts=2, seq_len=16)
    assert result["max_abs_dlogit"] < 1e-4 and result["max_kl"] < 1e-8, result
    assert result["argmax_agreement"] == 1.0


@pytest.mark.gloo
def test_llama_pp2_import_round_trips(dense, tmp_path):
    hf_dir, _ = dense["llama"]
    run_tool(_tool("convert_hf_to_megatron").convert_hf_to_megatron, 2, str(hf_dir),
             str(tmp_path / "pp2"), pp=2)
    _tool("convert_megatron_to_hf").convert_megatron_to_hf(str(tmp_path / "pp2"),
                                                           str(tmp_path / "back"))
    src, dst = _tensors(hf_dir), _tensors(tmp_path / "back")
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)


@pytest.mark.gloo
def test_verify_sees_a_wrong_tied_embedding(dense, tmp_path):
    """The tied output layer is the embedding: perturbing the HF embedding must show in logits."""
    import shutil

    from safetensors.torch import save_file

    hf_dir, mcore = dense["llama"]
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 1.5
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    result = _tool("verify_conversion").verify_conversion(str(bad), str(mcore), tp=1,
                                                          num_prompts=2, seq_len=16)
    assert result["max_abs_dlogit"] > 1e-2


def _live_worker(rank, world, hf_dir, mcore, tp, pp, out_path):
    from megatron.core import parallel_state as ps

    from megatron_pdm.convert.checkpoint import load_model
    from megatron_pdm.convert.live import gather_hf_state_dict
    from megatron_pdm.mcore.parallel import init_model_parallel

    init_model_parallel(tp, 1, pp)
    model, arch, _ = load_model(mcore, tp=tp, ep=1, pp=pp)
    if arch.tie_word_embeddings and pp > 1 and ps.is_pipeline_last_stage():
        # the last stage's copy of the tied embedding was loaded from the embedding's key
        embed = load_file(f"{hf_dir}/model.safetensors")["model.embed_tokens.weight"]
        copy = model.output_layer.weight.detach()
        assert torch.equal(copy[: embed.shape[0]], embed) and not copy[embed.shape[0]:].any()
    state = gather_hf_state_dict(model, arch)
    if rank == 0:
        torch.save(state, out_path)


@pytest.mark.gloo
@pytest.mark.parametrize("family,tp,pp", [("llama", 2, 1), ("llama", 1, 2), ("qwen3", 1, 2)],
                         ids=["llama-tp2", "llama-pp2", "qwen3-pp2"])
def test_live_export_of_a_loaded_dense_model(dense, tmp_path, family, tp, pp):
    hf_dir, mcore = dense[family]  # written at TP 2; vocab 1000 pads to 1024 at TP 1 and 2
    run_gloo(_live_worker, 2, str(hf_dir), str(mcore), tp, pp, str(tmp_path / "out.pt"))
    got, want = torch.load(tmp_path / "out.pt"), _tensors(hf_dir)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
