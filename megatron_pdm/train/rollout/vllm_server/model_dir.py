"""The model directory a CPU vLLM server serves for a run config.

`prepare_model_dir` writes an HF directory (config.json + random safetensors) of the run's
architecture (`run_arch`: the `model` section, vocabulary from the task or the checkpoint), so
vLLM serves exactly the network the trainer trains; the trainer pushes its own weights before the
first rollout (`rollout.sync_at_start`), so the random start weights never produce a rollout.
`check_servable` refuses shapes vLLM's CPU backend cannot serve or reload in place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def check_servable(arch) -> None:
    """Refuses architectures vLLM's CPU backend cannot serve or reload in place."""
    from megatron_pdm.configtree import ConfigError

    if arch.head_dim < 32:
        raise ConfigError(f"model.head_dim={arch.head_dim}: vLLM's CPU attention needs "
                          "head_dim >= 32")
    if arch.num_experts and arch.moe_ffn_hidden_size % 32:
        raise ConfigError(f"model.moe_ffn_hidden_size={arch.moe_ffn_hidden_size}: vLLM's CPU MoE "
                          "kernel pads it to a multiple of 32, and a padded layer cannot be "
                          "reloaded in place (weight sync)")


def run_arch(cfg):
    """The run's `ModelArch` with the vocabulary resolved (task tokenizer or checkpoint)."""
    from megatron_pdm.train import model_setup as ms
    from megatron_pdm.train.task import build_task

    task = build_task(cfg)
    meta = ms.read_checkpoint_meta(cfg.checkpoint.load_dir) if cfg.checkpoint.load_dir else None
    return ms.resolve_arch(cfg, task.vocab_size, meta=meta)


def prepare_model_dir(arch, out_dir: str | os.PathLike, *, seed: int = 0,
                      dtype: str = "float32") -> Path:
    """An HF directory of `arch` (its family: Qwen3-MoE, dense Qwen3, Llama) with random weights.

    The weights only have to have the right names and shapes: the trainer pushes its own before
    the first rollout. Norm weights are ones, the rest N(0, 0.02).
    """
    import torch
    from safetensors.torch import save_file

    from megatron_pdm.convert import mapping

    check_servable(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = arch.to_hf_config()
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in mapping.hf_shapes(arch, "per_expert").items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * 0.02
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    return out
