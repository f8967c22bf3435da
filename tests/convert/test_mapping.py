"""Pure-torch mapping checks: QKV interleave, expert layouts, HF checkpoint validation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_pdm.convert import expert_layouts, mapping
from megatron_pdm.convert.hf_io import HFReader, ShardedSafetensorsWriter, parse_size
from megatron_pdm.arch import ModelArch

ARCH = ModelArch(
    vocab_size=1000,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
)


def test_qkv_fusion_interleaves_query_groups_and_inverts():
    q = torch.arange(4 * 16 * 3, dtype=torch.float32).view(64, 3)
    k, v = -torch.ones(32, 3), -2 * torch.ones(32, 3)
    qkv = mapping.fuse_qkv(q, k, v, ARCH)
    # group 0: q heads 0-1 (32 rows), k_0 (16), v_0 (16); then group 1
    assert torch.equal(qkv[:32], q[:32]) and torch.equal(qkv[32:48], k[:16])
    assert torch.equal(qkv[48:64], v[:16]) and torch.equal(qkv[64:96], q[32:])
    for a, b in zip(mapping.split_qkv(qkv, ARCH), (q, k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("style", ["te", "legacy"])
def test_grouped_expert_layouts_round_trip(style):
    seq = {
        f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight": torch.randn(64, 16)
        for j in range(4)
    }
    seq |= {
        f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc2.weight": torch.randn(16, 32)
        for j in range(4)
    }
    seq["decoder.layers.0.mlp.router.weight"] = torch.randn(8, 16)
    grouped = expert_layouts.sequential_to_grouped(seq, style)
    if style == "te":
        assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in grouped
    else:
        assert grouped["decoder.layers.0.mlp.experts.weight1"].shape == (16, 4 * 64)
        assert grouped["decoder.layers.0.mlp.experts.weight2"].shape == (4 * 32, 16)
    back = expert_layouts.grouped_to_sequential(grouped, hidden_size=16, num_local_experts=4)
    assert back.keys() == seq.keys()
    assert all(torch.equal(back[k], seq[k]) for k in seq)


def test_hf_checkpoint_validation_names_the_tensor(tiny_hf, tmp_path):
    hf_dir, fused_dir, _ = tiny_hf
    assert mapping.check_hf_tensors(HFReader(hf_dir), ARCH) == "per_expert"
    assert mapping.check_hf_tensors(HFReader(fused_dir), ARCH) == "fused"
    state = load_file(str(hf_dir / "model.safetensors"))
    cases = {
        "mis-shaped": ("model.layers.1.self_attn.k_proj.weight", torch.zeros(16, 64)),
        "missing": ("model.layers.0.mlp.experts.3.up_proj.weight", None),
        "unexpected": ("model.layers.0.mlp.shared_expert.weight", torch.zeros(4)),
    }
    for kind, (name, value) in cases.items():
        bad = tmp_path / kind
        bad.mkdir()
        shutil.copy(hf_dir / "config.json", bad / "config.json")
        s = dict(state)
        if value is None:
            del s[name]
        else:
            s[name] = value
        save_file(s, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            mapping.check_hf_tensors(HFReader(bad), ARCH)


def test_sharded_writer_splits_and_indexes(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=900)
    for k, v in tensors.items():
        writer.add(k, v)
    files = writer.finish()
    assert len(files) == 3 and files[0] == "model-00001-of-00003.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 400
    reader = HFReader(tmp_path)
    assert all(torch.equal(reader.get(k), v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="t0"):
        w = ShardedSafetensorsWriter(tmp_path / "x", 10)
        w.add("t0", tensors["t0"])
        w.add("t0", tensors["t0"])
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20


def test_canonical_shapes_match_the_megatron_model_names():
    shapes = mapping.canonical_shapes(ARCH)
    assert shapes["embedding.word_embeddings.weight"] == (1024, 64)
    assert shapes["decoder.layers.1.self_attention.linear_qkv.weight"] == ((4 + 4) * 16, 64)
    assert shapes["decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight"] == (64, 64)
    assert len(mapping.hf_shapes(ARCH, "per_expert")) == 3 + 2 * (9 + 8 * 3)
    assert len(mapping.hf_shapes(ARCH, "fused")) == 3 + 2 * (9 + 2)


def test_legacy_grouped_layout_matches_groupedmlp_views():
    """GroupedMLP.forward uses weight1.view(E, H, -1)[j], weight2.view(E, -1, H)[j] as fc^T."""
    fc1 = [torch.randn(64, 16) for _ in range(4)]
    fc2 = [torch.randn(16, 32) for _ in range(4)]
    seq = {f"mlp.experts.local_experts.{j}.linear_fc1.weight": fc1[j] for j in range(4)}
    seq |= {f"mlp.experts.local_experts.{j}.linear_fc2.weight": fc2[j] for j in range(4)}
    g = expert_layouts.sequential_to_grouped(seq, "legacy")
    x = torch.randn(3, 16)
    w1, w2 = g["mlp.experts.weight1"], g["mlp.experts.weight2"]
    assert w1.shape == (16, 4 * 64) and w2.shape == (4 * 32, 16)
    for j in range(4):
        h = torch.randn(3, 32)
        assert torch.allclose(x @ w1.view(4, 16, -1)[j], x @ fc1[j].t(), atol=1e-6)
        assert torch.allclose(h @ w2.view(4, -1, 16)[j], h @ fc2[j].t(), atol=1e-6)
