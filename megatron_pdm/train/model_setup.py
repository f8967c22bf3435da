"""Run config -> architecture, megatron TransformerConfig settings, initial weights.

- `resolve_arch`: the `ModelArch` of the run. Without `checkpoint.load_dir` it is the `model`
  section (vocabulary: `model.vocab_size` or the task tokenizer's). With `load_dir` it is the
  checkpoint's `pdm_model.json` arch: `checkpoint.arch_from_load_dir: true` takes it as is,
  otherwise every weight-shaping field of the `model` section must agree with it
  (`ArchMismatchError` names each field).
  The task's vocabulary must fit into the model's (ids beyond it are never produced).
- `megatron_kwargs`: `precision.*` and `train.recompute` -> TransformerConfig fields:
  params_dtype fp32|bf16 (bf16: `bf16=True`, fp32 main grads and Adam in the optimizer),
  fp8 e4m3|hybrid + fp8_recipe delayed|tensorwise|blockwise|mxfp8 (Transformer Engine only),
  recompute full (uniform, 1 layer per chunk) | selective (megatron's default: core attention).
- `check_runtime`: FP8 needs transformer-engine and CUDA; refused with a clear error otherwise.
- `load_initial_weights`: reads the converted dist checkpoint into this rank's GPTModel at any
  TP/EP/PP (vocab padding must agree; the TE/local pre-MLP-norm key is renamed as needed).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from megatron_pdm.arch import ModelArch
from megatron_pdm.configtree import ConfigError
from megatron_pdm.train.config import RunConfig

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ArchMismatchError(ConfigError):
    """The config's model section disagrees with the checkpoint's architecture."""


def read_checkpoint_meta(load_dir: str) -> dict:
    from megatron_pdm.convert.checkpoint import read_meta

    return read_meta(load_dir)


def resolve_arch(cfg: RunConfig, task_vocab: int, *, meta: dict | None = None) -> ModelArch:
    """The run's ModelArch (see module docstring). `meta`: pdm_model.json, if loading."""
    model = cfg.model
    if meta is not None:
        ckpt = ModelArch.from_dict(meta["arch"],
                                      path=f"{cfg.checkpoint.load_dir}/pdm_model.json")
        if cfg.checkpoint.arch_from_load_dir:
            # the non-weight fields (init scale, aux-loss coefficient) still come from the config
            arch = dataclasses.replace(ckpt, init_method_std=model.init_method_std,
                                       moe_aux_loss_coeff=model.moe_aux_loss_coeff)
        else:
            diffs = model.differences(ckpt)
            if diffs:
                raise ArchMismatchError(
                    f"model section disagrees with {cfg.checkpoint.load_dir}/pdm_model.json:\n  "
                    + "\n  ".join(diffs)
                    + "\n(fix the model section or set checkpoint.arch_from_load_dir=true)")
            arch = dataclasses.replace(model, vocab_size=ckpt.vocab_size)
    else:
        arch = dataclasses.replace(model, vocab_size=model.vocab_size or task_vocab)
    if task_vocab > arch.require_vocab():
        raise ConfigError(f"task vocabulary ({task_vocab}) is larger than the model's "
                          f"({arch.vocab_size})")
    return arch


def megatron_kwargs(cfg: RunConfig) -> dict:
    """TransformerConfig keyword arguments of `precision` and `train.recompute`."""
    p = cfg.precision
    kwargs: dict = {"params_dtype": _DTYPES[p.params_dtype], "bf16": p.params_dtype == "bf16"}
    if p.fp8 is not None:
        kwargs.update(fp8=p.fp8, fp8_recipe=p.fp8_recipe)
    if cfg.train.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    elif cfg.train.recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    return kwargs


def use_te(cfg: RunConfig) -> bool:
    """The Transformer Engine layer spec is used for FP8 (and only then: CPU has no TE)."""
    return cfg.precision.fp8 is not None


def key_style(cfg: RunConfig) -> str:
    return "te" if use_te(cfg) else "local"


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def check_runtime(cfg: RunConfig, *, cuda: bool | None = None, te: bool | None = None,
                  capability: tuple[int, int] | None = None,
                  torch_cuda: str | None = None) -> None:
    """Refuses settings the machine cannot run (FP8 without CUDA or transformer-engine; bf16
    params without CUDA: megatron-core 0.16.1's unfused softmax builds its causal mask with
    device="cuda" for 16-bit inputs, measured on CPU)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cfg.precision.params_dtype == "bf16" and not cuda:
        raise RuntimeError(
            "precision.params_dtype=bf16 needs a CUDA GPU: megatron-core's softmax for 16-bit "
            "activations (fused_softmax.forward_torch_softmax -> get_default_causal_mask) "
            "allocates on 'cuda'. Use precision.params_dtype=fp32 on CPU.")
    if cfg.train.recompute != "none" and not cuda:
        raise RuntimeError(
            f"train.recompute={cfg.train.recompute} needs a CUDA GPU: under megatron's "
            "activation checkpointing the softmax's causal mask is allocated on 'cuda' "
            "(measured on CPU for recompute=full). Use train.recompute=none on CPU.")
    if cfg.precision.fp8 is None:
        return
    te = have_transformer_engine() if te is None else te
    missing = [what for what, ok in (("a CUDA GPU", cuda), ("transformer-engine", te)) if not ok]
    if missing:
        raise RuntimeError(
            f"precision.fp8={cfg.precision.fp8} (recipe {cfg.precision.fp8_recipe}) needs "
            f"{' and '.join(missing)}: FP8 runs only through Transformer Engine layers on "
            "Hopper/Blackwell GPUs. Use precision.fp8=null on this machine.")
    from megatron_pdm.mcore.fp8 import check_fp8_recipe

    if capability is None and torch.cuda.is_available():
        capability, torch_cuda = torch.cuda.get_device_capability(), torch.version.cuda
    if capability is not None:  # the recipe against this GPU and torch build (TE's rules)
        check_fp8_recipe(cfg.precision.fp8_recipe, capability, torch_cuda)


def seq_multiple(cfg: RunConfig) -> int:
    """The multiple packed sequence lengths are padded to (TP split, FP8 row alignment)."""
    from megatron_pdm.mcore.fp8 import seq_multiple as rule

    p = cfg.precision
    return rule(tp=cfg.parallel.tp, fp8_recipe=p.fp8_recipe if p.fp8 is not None else None)


def load_initial_weights(module: torch.nn.Module, load_dir: str, meta: dict, *, tp: int,
                         style: str) -> None:
    """Collective: loads the converted dist checkpoint into this rank's GPTModel."""
    from megatron.core import dist_checkpointing

    from megatron_pdm.convert.checkpoint import check_vocab_padding, rename_for_key_style
    from megatron_pdm.convert.load_dir import weights_dir

    arch = ModelArch.from_dict(meta["arch"])
    check_vocab_padding(arch, meta["layout_at_import"]["tp"], tp)
    from megatron_pdm.mcore.fp8 import drop_extra_state

    # TE's `_extra_state` (FP8 metadata) is absent from converted checkpoints: not requested
    sharded = drop_extra_state(
        rename_for_key_style(module.sharded_state_dict(), style, meta["key_style"]))
    # load_dir: what Megatron-LM's --load is given (tracker + release/), or a dist checkpoint
    state = dist_checkpointing.load(sharded, weights_dir(load_dir))
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{load_dir}: checkpoint/model mismatch: missing={missing} "
                         f"unexpected={unexpected}")
    logger.info("loaded initial weights from %s", os.path.abspath(load_dir))
