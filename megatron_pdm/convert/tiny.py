"""The tiny random HF models (Qwen3-MoE; dense Llama and Qwen3 below) used by the conversion tests and the conversion example of docs/conversion.md.

vocab 1000, hidden 64, 2 layers, 4 query heads / 2 KV groups of width 16, 8 experts top-2
(moe_intermediate 32), untied embeddings, RoPE base 1e6; weights drawn by transformers' own
initialiser from `seed`, norm weights perturbed so they are not all ones (a mapping that mixed up
two norms would otherwise still pass). Saved by `save_pretrained` (per-expert layout) or as one
safetensors file of transformers' in-memory fused layout (`gate_up_proj [E, 2I, H]`).
"""

from __future__ import annotations

from pathlib import Path

TINY_CONFIG = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
}
EXPERT_LAYOUTS = ("per_expert", "fused")


def tiny_model(seed: int = 0):
    """The random `Qwen3MoeForCausalLM` (in memory)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_tiny_hf(out_dir: str | Path, *, seed: int = 0, expert_layout: str = "per_expert"):
    """Writes the tiny model to `out_dir` (config.json + safetensors). Returns the model."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    model = tiny_model(seed)
    out = Path(out_dir)
    if expert_layout == "per_expert":
        model.save_pretrained(out)  # transformers writes the hub's per-expert tensors
        return model
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model


# ------------------------------------------------------------------------------ dense families

TINY_DENSE_CONFIGS = {
    # Llama, tied embeddings, no q/k norm (the SmolLM2 shape, scaled down)
    "llama": {
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rope_theta": 1e5, "rms_norm_eps": 9.999999747378752e-06,
        "tie_word_embeddings": True, "initializer_range": 0.2,
    },
    # dense Qwen3, untied, q/k norm
    "qwen3": {
        "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rope_theta": 1e6, "tie_word_embeddings": False,
        "initializer_range": 0.2,
    },
}


def tiny_dense_model(family: str, seed: int = 0):
    """A random dense `LlamaForCausalLM` (tied) or `Qwen3ForCausalLM` (untied, q/k norm), with
    the norm weights perturbed as in `tiny_model`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in TINY_DENSE_CONFIGS:
        raise ValueError(f"family must be one of {sorted(TINY_DENSE_CONFIGS)}, got {family!r}")
    cfg = dict(TINY_DENSE_CONFIGS[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_tiny_dense_hf(out_dir: str | Path, family: str, *, seed: int = 0):
    """Writes the tiny dense model of `family` to `out_dir` (save_pretrained). Returns it."""
    model = tiny_dense_model(family, seed)
    model.save_pretrained(Path(out_dir))
    return model
