"""HF -> megatron (TP2 x EP2, world 2) -> HF round trip, verification at other layouts, refusals.

Multi-process (gloo) runs on CPU; the whole file takes ~1 minute on 2 cores.
"""

from __future__ import annotations

import importlib
import os
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support._dist import run_tool

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _tool(name):
    return importlib.import_module(f"megatron_pdm.tools.{name}")


def _all_tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def converted(tiny_hf, tmp_path_factory):
    hf_dir, fused_dir, _ = tiny_hf
    out = tmp_path_factory.mktemp("mcore") / "tp2ep2"
    seconds = _tool("convert_hf_to_megatron").convert_hf_to_megatron(
        str(hf_dir), str(out), tp=2, ep=2
    )
    print(f"import TP2xEP2: {seconds:.1f} s")
    return out


@pytest.mark.gloo
def test_import_writes_the_megatron_lm_load_layout(converted):
    """`--load <out>` in Megatron-LM: tracker "release" -> `<out>/release`, a torch_dist
    checkpoint (megatron/training/checkpointing.py: read_metadata, get_checkpoint_name,
    _get_checkpoint_format), whose tensors are GPTModel.sharded_state_dict() keys."""
    from megatron.core import dist_checkpointing

    from megatron_pdm.convert.export import read_metadata

    tracker = converted / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "release"
    release = converted / "release"
    assert dist_checkpointing.check_is_distributed_checkpoint(str(release))
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    keys = read_metadata(str(release))
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys
    assert "embedding.word_embeddings.weight" in keys and "output_layer.weight" in keys
    assert (converted / "pdm_model.json").is_file()
    assert not (converted / "metadata.json").exists()  # nothing but the layout at the top


@pytest.mark.gloo
def test_round_trip_is_bit_exact(tiny_hf, converted, tmp_path):
    hf_dir, _, _ = tiny_hf
    meta = json.loads((converted / "pdm_model.json").read_text())
    assert meta["arch"]["num_experts"] == 8 and meta["layout_at_import"]["tp"] == 2
    summary = _tool("convert_megatron_to_hf").convert_megatron_to_hf(
        str(converted), str(tmp_path / "hf2"), max_shard_size="300KB"
    )
    print(f"export: {summary}")
    assert len(summary["files"]) > 1  # sharded with an index
    assert (tmp_path / "hf2" / "model.safetensors.index.json").exists()
    src, dst = _all_tensors(hf_dir), _all_tensors(tmp_path / "hf2")
    assert src.keys() == dst.keys()
    for name in src:
        assert src[name].dtype == dst[name].dtype and torch.equal(src[name], dst[name]), name
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["vocab_size"] == 1000


@pytest.mark.gloo
def test_both_hf_expert_layouts_import_and_load_in_transformers(tiny_hf, converted, tmp_path):
    """Export fused and per-expert; transformers loads both to the same logits as the source."""
    from transformers import AutoModelForCausalLM

    _, fused_dir, model = tiny_hf
    export = _tool("convert_megatron_to_hf").convert_megatron_to_hf
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    for layout in ("fused", "per_expert"):
        export(str(converted), str(tmp_path / layout), expert_layout=layout)
        names = set(_all_tensors(tmp_path / layout))
        assert ("model.layers.0.mlp.experts.gate_up_proj" in names) == (layout == "fused")
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / layout, local_files_only=True)
        with torch.no_grad():
            got = loaded(input_ids=ids).logits
        assert (got - want).abs().max().item() < 1e-5, layout
    # the fused HF layout imports too (EP2 only) and exports bit-exact in its own layout
    out = tmp_path / "from_fused"
    _tool("convert_hf_to_megatron").convert_hf_to_megatron(str(fused_dir), str(out), ep=2)
    export(str(out), str(tmp_path / "fused_back"))
    src, dst = _all_tensors(fused_dir), _all_tensors(tmp_path / "fused_back")
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)


@pytest.mark.gloo
def test_verify_at_another_layout(tiny_hf, converted):
    hf_dir, _, _ = tiny_hf
    result = _tool("verify_conversion").verify_conversion(
        str(hf_dir), str(converted), tp=2, ep=1, num_prompts=2, seq_len=16
    )
    print(f"verify TP2 (checkpoint written at TP2xEP2): {result}")
    assert result["max_abs_dlogit"] < 1e-4 and result["max_kl"] < 1e-8
    assert result["argmax_agreement"] == 1.0


@pytest.mark.gloo
def test_verify_detects_a_wrong_weight(tiny_hf, converted, tmp_path):
    """Perturb one expert in the HF copy: verification must see a large difference."""
    import shutil

    from safetensors.torch import save_file

    hf_dir, _, _ = tiny_hf
    bad = tmp_path / "hf_bad"
    shutil.copytree(hf_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.0.self_attn.o_proj.weight"] = (
        state["model.layers.0.self_attn.o_proj.weight"] * 2
    )
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    # on the pooled ranks (the in-group path of a torchrun launch; the tool's own spawn is
    # test_verify_at_another_layout's)
    result = run_tool(_tool("verify_conversion").verify_conversion, 2,
                      str(bad), str(converted), tp=1, ep=2, num_prompts=2, seq_len=16)
    assert result["max_abs_dlogit"] > 1e-2


@pytest.mark.gloo
def test_refuses_mis_shaped_and_tampered(tiny_hf, converted, tmp_path):
    import shutil

    from safetensors.torch import save_file

    hf_dir, _, _ = tiny_hf
    bad = tmp_path / "hf_bad"
    shutil.copytree(hf_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.1.mlp.gate.weight"] = torch.zeros(7, 64)
    save_file(state, str(bad / "model.safetensors"))
    convert = _tool("convert_hf_to_megatron").convert_hf_to_megatron
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate\.weight"):
        convert(str(bad), str(tmp_path / "never"), tp=2)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by EP=3"):
        convert(str(hf_dir), str(tmp_path / "never"), ep=3)
    # a checkpoint whose recorded architecture disagrees with its tensors is refused on export
    tampered = tmp_path / "tampered"
    shutil.copytree(converted, tampered)
    meta = json.loads((tampered / "pdm_model.json").read_text())
    meta["arch"]["moe_ffn_hidden_size"] = 48
    (tampered / "pdm_model.json").write_text(json.dumps(meta))
    export = _tool("convert_megatron_to_hf").convert_megatron_to_hf
    with pytest.raises(ValueError, match=r"experts\.experts\.linear_fc1\.weight"):
        export(str(tampered), str(tmp_path / "never_hf"))


def test_make_tiny_hf_tool_writes_the_readme_model(tiny_hf, tmp_path):
    """`python -m megatron_pdm.tools.make_tiny_hf --out DIR` (the first conversion step of
    docs/conversion.md) writes the tiny model these tests convert: same config, bit-identical
    tensors for the same seed."""
    import subprocess

    hf_dir, _, _ = tiny_hf
    out = tmp_path / "tiny_hf"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megatron_pdm.tools.make_tiny_hf", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny random Qwen3-MoE" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    # transformers 5 writes num_experts as num_local_experts
    experts = config.get("num_experts", config.get("num_local_experts"))
    assert (config["vocab_size"], config["hidden_size"], experts) == (1000, 64, 8)
    src, dst = _all_tensors(hf_dir), _all_tensors(out)
    assert src.keys() == dst.keys()
    assert all(torch.equal(src[k], dst[k]) for k in src)
