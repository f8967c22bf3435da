"""A tiny random Qwen3-MoE saved by transformers (config only, no hub), in both expert layouts."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_theta=1e6,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def make_tiny_hf(path, *, seed: int = 0):
    """save_pretrained of a random model (norm weights perturbed so they are not all ones)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(per-expert dir as written by save_pretrained, fused-layout dir, the in-memory model)."""
    import shutil

    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model = make_tiny_hf(root / "hf")
    fused = root / "hf_fused"
    fused.mkdir()
    shutil.copy(root / "hf" / "config.json", fused / "config.json")
    # transformers' in-memory layout is the fused one
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    return root / "hf", fused, model
