"""RunConfig -> Qwen3MoeArch (kept apart from the trainer so --dry-run stays light)."""

from __future__ import annotations

from megatron_pdm.train.config import RunConfig


def make_arch(cfg: RunConfig, vocab_size: int):
    """The Qwen3MoeArch of the run (vocab from the task tokenizer)."""
    from megatron_pdm.megatron.model import Qwen3MoeArch

    m = cfg.model
    return Qwen3MoeArch(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        head_dim=m.head_dim, num_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size, rotary_base=m.rotary_base,
        norm_epsilon=m.norm_epsilon, max_position_embeddings=m.max_position_embeddings,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by)


