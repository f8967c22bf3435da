"""The fused LM head in the Megatron model: the output layer hands hidden states to the loss.

With `train.fused_head: true` the trainer builds its model with `build_model(...,
fused_head=True)`, which calls `install_fused_head(gpt)`. On the last pipeline stage the output
layer (megatron's `ColumnParallelLinear`, `gpt.output_layer`) becomes a `FusedHeadOutputLayer`:
the same module, parameters, names and state dict (only its class changes; it adds no state), whose
forward does the output layer's tensor/sequence-parallel communication but not its matmul, and
returns the hidden states `[s, b, H]` where megatron returns the logits `[s, b, V_local]`:

    SP on             all-gather of hidden [s/TP, b, H] along the sequence over TP -> [s, b, H];
                      backward: reduce-scatter of grad_h (ColumnParallelLinear all-gathers its
                      sequence-parallel input the same way before its matmul)
    SP off, TP > 1    identity; backward: all-reduce SUM of grad_h over TP (megatron's
                      `allreduce_dgrad`: every rank's vocab shard contributes a partial grad_h)
    TP 1              nothing

GPTModel's labels=None path then returns them as `[b, s, H]` (it transposes whatever its output
layer returned). The loss applies the head itself: `lm_head_of(model)` gives an `LMHead` whose
`weight()` is the `[V_local, H]` shard the output layer would have multiplied by, resolved as
`GPTModel._postprocess` does (`shared_embedding_or_output_weight()` when
`share_embeddings_and_output_weights`, else `output_layer.weight`), and the loss adapter
(mcore/loss_adapter.py, `batch_token_stats(..., head=...)`) calls the fused op
(parallel/fused_head.py) on hidden states and that weight: the `[N, V_local]` logits never exist.
Gradients reach the weight through autograd (the op returns grad_W), so a tied embedding gets the
sum of its two uses' gradients, as with the unfused head.

Refused (a clear error at install): multi-token prediction (megatron computes its MTP losses from
output-layer logits), deferred embedding wgrad, an output layer that gathers its logits
(parallel_output=False), an output layer that is not megatron's ColumnParallelLinear. Context
parallelism is not part of this project's layouts (docs/op.md, "Fused LM head in the model").

Shape legend: s sequence, b batch, H hidden, V_local this rank's padded vocabulary shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_sequence_parallel_region,
)

from megatron_pdm.parallel.fused_head import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK

__all__ = ["FusedHeadOutputLayer", "LMHead", "install_fused_head", "lm_head_of"]


class _AllReduceGradH(torch.autograd.Function):
    """Identity forward; backward all-reduce SUM of grad_h over the TP group.

    Not megatron's `copy_to_tensor_model_parallel_region`: its backward all-reduces
    `grad.contiguous()` and returns `grad`, so a non-contiguous gradient (which is what
    GPTModel's `[s, b, H] -> [b, s, H]` transpose hands back here) leaves it unreduced.
    """

    @staticmethod
    def forward(ctx, hidden_sbh, group):
        ctx.group = group
        return hidden_sbh.view_as(hidden_sbh)

    @staticmethod
    def backward(ctx, grad_sbh):
        grad_sbh = grad_sbh.clone(memory_format=torch.contiguous_format)
        # Collective: all-reduce SUM of grad_h [s, b, H] over TP (each rank's vocab shard
        # contributes a partial grad_h; ColumnParallelLinear's allreduce_dgrad).
        dist.all_reduce(grad_sbh, group=ctx.group)
        return grad_sbh, None


class FusedHeadOutputLayer(ColumnParallelLinear):
    """megatron's output layer without its matmul: returns (hidden [s, b, H], None).

    Installed over an existing ColumnParallelLinear by `install_fused_head` (class swap: the
    weight, its attributes and the state dict are the layer's own). `token_chunk` and
    `vocab_chunk` are the fused op's chunk shape (parallel/fused_head.py).
    """

    token_chunk: int = DEFAULT_TOKEN_CHUNK
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if runtime_gather_output:
            raise ValueError("fused LM head: runtime_gather_output=True asks for full-vocabulary "
                             "logits, which this output layer never computes (inference and "
                             "rollouts use a model built without train.fused_head)")
        expected = (self.output_size_per_partition, self.input_size)
        if weight is not None and tuple(weight.shape) != expected:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not "
                               f"{expected} as expected")
        if self.sequence_parallel:
            # Collective: all-gather of hidden [s/TP, b, H] along the sequence over TP
            # -> [s, b, H]; backward: reduce-scatter of grad_h (as ColumnParallelLinear's SP input).
            hidden_sbh = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=self.tp_group)
        elif self.allreduce_dgrad:
            # Collective (backward only): all-reduce SUM of grad_h over TP (_AllReduceGradH).
            hidden_sbh = _AllReduceGradH.apply(input_, self.tp_group)
        else:
            hidden_sbh = input_
        return hidden_sbh, None


def install_fused_head(gpt: torch.nn.Module, *, token_chunk: int = DEFAULT_TOKEN_CHUNK,
                       vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> torch.nn.Module:
    """Turns `gpt.output_layer` into a `FusedHeadOutputLayer` (in place; returns `gpt`).

    A stage without an output layer (not the last pipeline stage) is returned unchanged.
    """
    if not getattr(gpt, "post_process", False):
        return gpt
    layer = gpt.output_layer
    config = gpt.config
    if type(layer) is not ColumnParallelLinear:
        raise ValueError(f"fused LM head: the output layer is {type(layer).__name__}, not "
                         "megatron's ColumnParallelLinear")
    if getattr(config, "mtp_num_layers", None):
        raise ValueError("fused LM head: multi-token prediction (mtp_num_layers="
                         f"{config.mtp_num_layers}) computes its losses from output-layer logits")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("fused LM head: defer_embedding_wgrad_compute is not supported (the "
                         "fused op computes the weight gradient itself)")
    if layer.gather_output:
        raise ValueError("fused LM head: the output layer gathers its logits "
                         "(parallel_output=False); the fused head needs vocab-parallel output")
    for name, val in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"fused LM head: {name} must be an int >= 1, got {val!r}")
    layer.__class__ = FusedHeadOutputLayer
    layer.token_chunk, layer.vocab_chunk = token_chunk, vocab_chunk
    return gpt


@dataclass(frozen=True)
class LMHead:
    """What the loss needs to apply a fused model's LM head itself (see the module docstring)."""

    gpt: torch.nn.Module

    def weight(self) -> torch.Tensor:
        """[V_local, H]: the weight GPTModel hands (or leaves) to its output layer."""
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    @property
    def token_chunk(self) -> int:
        return self.gpt.output_layer.token_chunk

    @property
    def vocab_chunk(self) -> int:
        return self.gpt.output_layer.vocab_chunk

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> this rank's [..., V_local] logits: the output layer's matmul, for a loss
        that needs materialised logits (the supervised warm-up)."""
        return torch.matmul(hidden, self.weight().t())


def lm_head_of(model: Optional[torch.nn.Module]) -> Optional[LMHead]:
    """The `LMHead` of a model built with the fused head (unwrapping DDP / Float16Module), or
    None: a model with megatron's own output layer, a stage without one, or None."""
    while model is not None and not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    if model is None or not getattr(model, "post_process", False):
        return None
    if not isinstance(getattr(model, "output_layer", None), FusedHeadOutputLayer):
        return None
    return LMHead(model)
