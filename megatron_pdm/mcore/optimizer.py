"""megatron-core DDP wrapper and optimizer for the trainer, with the CPU-verified settings.

What: `wrap_ddp` puts the GPTModel into megatron's `DistributedDataParallel` (fp32 grad buffers,
no overlap, so the schedule's `finalize_model_grads` does the DP all-reduce and the sequence-
parallel norm all-reduce over TP), and `build_optimizer` returns `get_megatron_optimizer(...)`:
Adam on fp32 params, either the plain `FP32Optimizer` or the `DistributedOptimizer` (optimizer
state sharded over DP). Both run on CPU with the shim (docs/cpu-megatron.md §3).

Why the distributed-optimizer helpers: its checkpoint path has three megatron bugs without
apex/TE (docs/cpu-megatron.md §5.3, present in 0.16.1 and 0.19.2); `prime_for_loading` and
`fix_adam_step_after_load` are the measured workarounds, used by megatron_pdm.mcore.checkpoint.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# DistributedOptimizer checkpoints: the default sharding raises "flattened_range is not
# supported" and "fully_reshardable" raises KeyError('step') with torch Adam (§5.3).
DIST_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def mark_replicated_experts(model: torch.nn.Module, config) -> int:
    """Routes expert gradients through the expert-data-parallel reduction when EP == 1.

    megatron-core tags expert weights `allreduce = not expert_parallel`, i.e. only when EP > 1
    are they reduced over the expert-data-parallel group. With TP > 1, expert TP = 1 and EP = 1
    (our CPU layout), every TP rank runs its own sequence-parallel slice of tokens through a full
    replica of the experts, so the replicas must sum their gradients over the TP ranks (which
    form the expert-data-parallel group). Left as `allreduce=True` they are reduced over the
    dense DP group only and silently diverge across TP ranks (measured: after 30 steps the
    replicas differed by 0.09 and the model stopped being causal, because a token's output
    depended on which TP rank its sequence slice landed on). Returns the number of re-tagged
    parameters. Must run before DDP and the optimizer are built.
    """
    if config.expert_model_parallel_size > 1 or config.tensor_model_parallel_size == 1:
        return 0
    if (config.expert_tensor_parallel_size or config.tensor_model_parallel_size) != 1:
        return 0
    count = 0
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.allreduce = False
            count += 1
    return count


def wrap_ddp(model: torch.nn.Module, config, *, use_distributed_optimizer: bool):
    """Wraps `model` in megatron DDP and broadcasts params so every DP replica starts equal."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    mark_replicated_experts(model, config)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    # CPU cannot fork the CUDA RNG tracker: guarantee DP-consistent init explicitly.
    ddp.broadcast_params()
    return ddp


def build_optimizer(ddp_model, *, lr: float, weight_decay: float, clip_grad: float,
                    adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
                    use_distributed_optimizer: bool = False, params_dtype: str = "fp32",
                    use_gloo_process_groups: bool = True):
    """megatron-core Adam (`get_megatron_optimizer`) over the DDP-wrapped model.

    `params_dtype="bf16"`: bf16 model params with fp32 main params, grads and Adam state
    (megatron's Float16OptimizerWithFloat16Params, or the DistributedOptimizer's fp32 shards).

    `use_gloo_process_groups=False`: the simulation (mcore/fake_sim.py), whose fake process
    group has no gloo side groups (they only serve the distributed optimizer's checkpoint gather).

    Returns a `ChainedOptimizer` (dense and expert parameter groups) or a single optimizer.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
        adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
        bf16=params_dtype == "bf16", fp16=False,
        params_dtype=torch.bfloat16 if params_dtype == "bf16" else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return get_megatron_optimizer(cfg, [ddp_model], use_gloo_process_groups=use_gloo_process_groups)


def set_lr(optimizer, lr: float) -> None:
    """Sets the learning rate of every param group (we use a constant LR per phase)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def sub_optimizers(optimizer) -> list:
    """The leaf megatron optimizers (ChainedOptimizer holds one per param kind)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in sub_optimizers(optimizer))


def prime_for_loading(ddp_model, optimizer) -> None:
    """§5.3 workaround 1: the DistributedOptimizer can only build a loading state dict once Adam
    has state. Take one step with zero grads; the loaded checkpoint overwrites params and state.
    """
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()


def fix_adam_step_after_load(optimizer, loaded_optimizer_state: dict) -> None:
    """§5.3 workaround 3: after a DistributedOptimizer load, torch Adam's per-param `step` is
    wrong (one shared tensor incremented once per param, then overwritten by the stale pre-load
    value). Reset every param's step to the checkpointed common step.
    """
    subs = sub_optimizers(optimizer)
    lo = loaded_optimizer_state
    states = [lo] if "optimizer" in lo else [lo[i] for i in range(len(subs))]
    for opt, sub in zip(subs, states):
        step_value = float(sub["optimizer"]["param_groups"][0]["step"])
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = torch.tensor(step_value)
