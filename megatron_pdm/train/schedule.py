"""One optimizer step through megatron-core's pipeline schedule, and the metric reduction after it.

`optimizer_step` zeroes the gradient buffers, runs `get_forward_backward_func()` over a list of
micro-batches (1F1B when PP > 1, plain forward/backward otherwise) and steps the optimizer. A
micro-batch is any object with `tokens` and `position_ids` tensors `[b, s]` (the RL
`PackedBatch`, the warm-up's `SftBatch`); `loss_func_of(mb)` returns megatron's loss_func for it.

`rl_lr` is the RL phase's learning rate at a given optimizer step (linear warm-up, then constant).

`reduce_step_metrics` turns the per-micro-batch `[sum, count]` metrics of the last pipeline stage
into means over data-parallel ranks and hands them to every stage.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from megatron_pdm.mcore.device import to_device
from megatron_pdm.mcore.loss_adapter import reduce_metrics


class MicroBatch(Protocol):
    tokens: torch.Tensor
    position_ids: torch.Tensor


def optimizer_step(model, optimizer, microbatches: list[MicroBatch],
                   loss_func_of: Callable[[Any], Callable], *, pp: int,
                   timings: dict | None = None) -> tuple[list[dict], float]:
    """zero grads -> megatron forward_backward over `microbatches` -> optimizer step.

    `timings`, when given, receives the wall-clock seconds of the two phases: `fwd_bwd_s`
    (zeroing, forward and backward of every micro-batch, gradient finalisation) and
    `optimizer_s` (clipping and the optimizer's update).

    Returns:
        (the schedule's forward data store: one metrics dict per micro-batch on the last stage,
        the global gradient norm before clipping, nan if the optimizer did not report one).
    """
    t0 = time.perf_counter()
    store = forward_backward(model, optimizer, microbatches, loss_func_of, pp=pp)
    t1 = time.perf_counter()
    _, grad_norm, _ = optimizer.step()
    if timings is not None:
        timings["fwd_bwd_s"] = t1 - t0
        timings["optimizer_s"] = time.perf_counter() - t1
    return store, float(grad_norm) if grad_norm is not None else float("nan")


def forward_backward(model, optimizer, microbatches: list[MicroBatch],
                     loss_func_of: Callable[[Any], Callable], *, pp: int) -> list[dict]:
    """zero grads -> megatron forward_backward (gradients in the DDP buffers' `main_grad`,
    finalised by the model config's `finalize_model_grads_func`), no optimizer step.

    Returns:
        the schedule's forward data store (one metrics dict per micro-batch, last stage).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = to_device(next(data_iterator))  # packed on CPU; model and loss on the device
        # Under PP, stages after the first take the schedule's input tensor instead of tokens.
        output = model(mb.tokens, mb.position_ids, attention_mask=None)
        return output, loss_func_of(mb)

    if pp > 1:
        sizes = {tuple(m.tokens.shape) for m in microbatches}
        if len(sizes) != 1:
            raise ValueError(f"parallel.pp > 1 needs equal micro-batch shapes, got {sizes}: make "
                             "samples per minibatch divisible by DP x microbatches_per_minibatch")
    model.zero_grad_buffer()
    optimizer.zero_grad()
    b, s = microbatches[0].tokens.shape
    store = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
        num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
        forward_only=False)
    return store


def minibatch_plan(seed: int, iteration: int, num_samples: int,
                   num_minibatches: int, *, epoch: int = 0) -> tuple[torch.Tensor, ...]:
    """The driver's minibatches of one iteration: a permutation of the batch's sample indices
    seeded by (seed, iteration, epoch), split into `num_minibatches` chunks `[~num_samples / m]`.
    The trainer and the mask study both take their minibatches from here; epoch 0 is the
    permutation of runs without epochs."""
    g = torch.Generator().manual_seed(seed * 31 + iteration + epoch * 1_000_003)
    return torch.randperm(num_samples, generator=g).chunk(num_minibatches)


def dp_microbatches(idx: torch.Tensor, *, dp_size: int, dp_rank: int,
                    microbatches: int) -> list[torch.Tensor]:
    """This DP rank's slice of a minibatch's sample indices, split into micro-batches."""
    mine = idx.chunk(dp_size)[dp_rank]
    return [m for m in mine.chunk(microbatches) if len(m)]


def rl_lr(train_cfg, step: int) -> float:
    """Learning rate of RL optimizer step `step` (0-based): `train.lr` after a linear warm-up of
    `train.lr_warmup_steps` steps (step k uses lr * (k + 1) / lr_warmup_steps)."""
    warm = train_cfg.lr_warmup_steps
    if warm <= 0 or step >= warm:
        return train_cfg.lr
    return train_cfg.lr * (step + 1) / warm


def reduce_step_metrics(store: list[dict], *, dp_group, is_last_stage: bool,
                        pp: int) -> dict[str, float]:
    """Metric means over DP, computed on the last pipeline stage and sent to every stage."""
    means = reduce_metrics(store, dp_group) if is_last_stage else {}
    if pp == 1:
        return means
    from megatron.core import parallel_state as ps

    box = [means]
    # Object broadcast over the pipeline group: only the last stage holds the loss metrics.
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]
