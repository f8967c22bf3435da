"""Process groups for the trainer: torch.distributed + megatron-core parallel_state, on CPU or GPU.

What: `init_parallel(tp=, ep=, seed=)` starts torch.distributed (gloo without a GPU, nccl with
one) from the torchrun environment, applies the CPU shim when no GPU is present, initialises
megatron-core's tensor/expert/data parallel groups and seeds every RNG megatron uses.

Why one helper: the training driver and the multi-process tests must build identical layouts;
the CPU specifics (gloo, shim, expert tensor parallel size 1, which is the only layout gloo's
all-gather supports with the alltoall dispatcher) live here and nowhere else.

Seeding: all ranks seed torch identically. With `use_cpu_initialization=True` megatron builds
every TP-sharded weight from the full master weight and slices it, so TP shards are consistent.
On CPU the CUDA RNG tracker cannot fork, so expert weights on different EP ranks are drawn from
the same stream (identical local experts across EP ranks at init; the router breaks the symmetry).
Dense weights are made DP-consistent by `DistributedDataParallel.broadcast_params()`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_pdm.mcore.cpu_shim import apply_cpu_shim

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in the layout."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int


def init_model_parallel(tp: int, ep: int, pp: int) -> None:
    """megatron parallel_state for the layout (expert TP 1), after the process group exists."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def init_parallel(*, tp: int = 1, ep: int = 1, pp: int = 1, seed: int = 1234) -> ParallelInfo:
    """Initialise torch.distributed (if needed) and megatron's parallel_state.

    Args:
        tp: Tensor-parallel size (sequence parallelism is switched on by the model config).
        ep: Expert-parallel size (expert tensor parallel size is 1).
        pp: Pipeline-parallel size.
        seed: Seed for torch and megatron's model-parallel RNG.

    Returns:
        The rank's `ParallelInfo`.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu = apply_cpu_shim()
    if not dist.is_initialized():
        backend = "gloo" if cpu else "nccl"
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    if world % (tp * pp) or world % ep:
        raise ValueError(f"world size {world} not divisible by tp*pp={tp * pp} / ep={ep}")
    init_model_parallel(tp, ep, pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    info = current_parallel_info()
    logger.info("parallel layout: %s", info)
    return info


def current_parallel_info() -> ParallelInfo:
    """`ParallelInfo` from the initialised parallel_state."""
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


def destroy_parallel() -> None:
    """Tear down parallel_state and the default process group (tests call this in `finally`)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
