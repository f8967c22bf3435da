"""RunConfig -> Qwen3MoeArch without a checkpoint (apart from the trainer for light imports)."""

from __future__ import annotations

from megatron_pdm.train.config import RunConfig


def make_arch(cfg: RunConfig, vocab_size: int):
    """The Qwen3MoeArch of the model section (vocab: model.vocab_size or the task's)."""
    from megatron_pdm.train.model_setup import resolve_arch

    return resolve_arch(cfg, vocab_size, meta=None)
