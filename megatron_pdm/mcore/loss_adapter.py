"""The policy loss as a megatron-core `loss_func`.

megatron-core's schedules (`get_forward_backward_func()`) call
`forward_step_func(data_iterator, model) -> (output_tensor, loss_func)` and then
`loss_func(output_tensor)`. With `TransformerConfig.calculate_per_token_loss=True` a loss_func
returns `(loss_sum, num_tokens, {key: tensor([sum, count])})`: megatron back-propagates
`loss_sum`, sums `num_tokens` over micro-batches, all-reduces it over data parallel ranks and
divides the gradients by it in `finalize_model_grads`, so the update is an exact token (or
sequence) mean over the global batch. `make_loss_func` binds one micro-batch to that contract.
`batch_token_stats` is the batch -> `token_stats` call itself, shared with the mask study's
probe (analysis/megatron_probe.py), so both read a batch the same way.

What this adapter owns (and the core op does not):
- Layout. `GPTModel.forward(..., labels=None)` returns vocab-parallel logits `[b, s, Vl]`; the
  raw output layer produces `[s, b, Vl]`. Both are accepted (`layout="auto"` decides from the
  batch shape; when b == s it must be given). THD batches are `[1, total]`.
- Sequence parallelism. The output layer all-gathers the sequence before the vocab projection,
  so the logits are always full-sequence and vocab-sharded: nothing to undo here.
- The fused LM head (`head=`, a model built with `train.fused_head`: mcore/lm_head.py). The
  model's output is then the final hidden states `[b, s, H]` / `[s, b, H]` (full-sequence, the
  output layer having done its SP all-gather) and `head.weight()` this rank's `[V_local, H]`
  shard; `fused_token_stats` (parallel/fused_head.py) computes the same statistics without the
  `[N, V_local]` logits. Layout, row order, fields and checks are the logits path's.
- The t-1 -> t shift. The row-aligned `PackedBatch` (rollout_bridge.core.packing) already put every
  per-token field on the logits row that scores it: row p scores `labels[p] = tokens[p+1]`.
  No shifting happens here; only loss rows are selected (`loss_mask`).
- Tensor parallelism. The TP group comes from megatron's parallel_state and is handed to
  `megatron_pdm.token_stats`, which needs exactly 2 collectives per call.
- Logits dtype (one rule, decided by measured cost, docs/op.md "Logits dtype"): the op reads
  the LM head's output in its own dtype, never a cast copy. Under the bf16 and FP8 recipes that
  is bf16 (the op's bf16 path: fp32 arithmetic in chunks, a bf16 gradient; an fp32 copy would
  add 4 bytes per logit, and megatron's output layer has no fp32 mode here); with fp32 params
  the logits are fp32 and the op works in place.
- The rollout's facts. The sampling temperature (logits are divided by it inside
  `token_stats`) and the engine vocabulary (megatron's padded ids beyond it are excluded) are
  read from the batch, which the rollout engine stamped: there is no second argument to forget.
  A batch whose supports were checked when the engine produced them (`batch.validated`) runs the
  op and the loss with their input checks off, so the training step has no host sync.

Metric keys emitted: everything `megatron_pdm.policy_loss` emits (pdm/*, loss/pg,
mismatch/abs_logprob_diff; see megatron_pdm/metrics.py) plus `tokens/loss` (loss rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from megatron_pdm import metrics as M
from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.loss.policy_loss import policy_loss
from megatron_pdm.metrics import reduce_metrics  # noqa: F401  (its home is metrics.py)
from megatron_pdm.ops.stats import TokenStats
from megatron_pdm.parallel.fused_head import fused_token_stats
from megatron_pdm.parallel.vocab_parallel import token_stats

_FIELDS = ("labels", "loss_mask", "behavior_logprob", "support_ids", "support_logprobs",
           "support_valid", "advantages", "seq_ids")


def to_bsv(logits: torch.Tensor, b: int, s: int, layout: str = "auto") -> torch.Tensor:
    """Returns the logits as `[b, s, Vl]`.

    Args:
        logits: `[b, s, Vl]` ("bsv") or `[s, b, Vl]` ("sbv").
        b, s: Batch and sequence size of the packed batch.
        layout: "bsv", "sbv" or "auto" (decided from the shape; ambiguous when b == s != 1).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D [b, s, Vl] or [s, b, Vl], got {tuple(logits.shape)}")
    if layout == "auto":
        shape = tuple(logits.shape[:2])
        if shape == (b, s) and (b == s and b != 1):
            raise ValueError(f"layout ambiguous for b == s == {b}; pass layout='bsv' or 'sbv'")
        if shape == (b, s):
            layout = "bsv"
        elif shape == (s, b):
            layout = "sbv"
        else:
            raise ValueError(f"logits {tuple(logits.shape)} match neither [b={b}, s={s}, Vl] "
                             f"nor [s, b, Vl]")
    if layout == "bsv":
        if tuple(logits.shape[:2]) != (b, s):
            raise ValueError(f"logits {tuple(logits.shape)} are not [b={b}, s={s}, Vl]")
        return logits
    if layout == "sbv":
        if tuple(logits.shape[:2]) != (s, b):
            raise ValueError(f"logits {tuple(logits.shape)} are not [s={s}, b={b}, Vl]")
        return logits.transpose(0, 1)
    raise ValueError(f"unknown layout {layout!r}")


def _tp_group():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def batch_vocab_size(batch: Any) -> int:
    """The engine vocabulary the batch was generated with (a clear error when unknown)."""
    vocab_size = getattr(batch, "vocab_size", None)
    if vocab_size is None:
        raise ValueError("batch.vocab_size is None: the rollout engine did not record its "
                         "vocabulary; construct the engine with vocab_size=... (the loss must "
                         "know which of megatron's padded logits are real)")
    return int(vocab_size)


@dataclass(frozen=True)
class BatchStats:
    """`token_stats` of one packed batch, with its per-token fields in the same row order.

    Attributes:
        stats: the op's TokenStats over all N = b * s rows.
        fields: the batch's per-token fields (`labels`, `loss_mask`, `behavior_logprob`,
            `support_ids`, `support_logprobs`, `support_valid`, `advantages`, `seq_ids`)
            flattened to [N] / [N, S], row n of each scoring logits row n.
        rows: "bs" (row n = b_i * s + s_j) or "sb" (row n = s_j * b + b_i).
        checked: the op checked its inputs (the batch was not `validated` where it entered);
            the loss checks its own inputs under the same flag.
    """

    stats: TokenStats
    fields: dict[str, torch.Tensor]
    rows: str
    checked: bool


def batch_token_stats(output_tensor: torch.Tensor, batch: Any, *, layout: str = "auto",
                      tp_group: Any = "parallel_state", inplace: bool = False,
                      stats_dtype: torch.dtype | None = None,
                      head: Any = None) -> BatchStats:
    """The batch -> `token_stats` call of training and of the mask study (one place).

    The batch facts the rollout engine stamped are used as recorded: `temperature`,
    `vocab_size` (megatron's padded ids beyond it are excluded) and `validated` (checked
    batches run the op with its input checks off: no host sync).

    Args:
        output_tensor: logits `[b, s, Vl]` or `[s, b, Vl]` (this TP rank's vocab shard); with
            `head`, the final hidden states `[b, s, H]` or `[s, b, H]`.
        batch: a `PackedBatch`, padded `[b, s]` or THD `[1, total]`.
        layout: see `to_bsv`.
        tp_group: process group; default: megatron's TP group (None when TP == 1).
        inplace: let the op work in the logits' storage (fp32 logits; see `token_stats`;
            nothing to do with `head`).
        stats_dtype: cast the logits (with `head`: the hidden states and the weight) to this
            dtype first (a copy, always in "bs" row order); None: the op reads them as they
            are, as a view (no row-selection copy, like megatron's CE), in their own row order.
        head: None (the output is logits) or the model's `LMHead` (mcore/lm_head.py,
            `lm_head_of(model)`): the output is hidden states and `fused_token_stats` applies
            `head.weight()` [V_local, H] chunk by chunk.
    """
    labels_bs = batch.labels
    b, s = labels_bs.shape
    out_bsx = to_bsv(output_tensor, b, s, layout)
    group = _tp_group() if tp_group == "parallel_state" else tp_group
    # out_*X: logits (X = Vl) or, with `head`, hidden states (X = H). All rows go through the
    # op: rows without a loss carry an all-invalid support and loss_mask False, so they add no
    # gradient. For an [s, b, X] output viewed without a copy the small per-token fields are
    # transposed instead.
    if stats_dtype is not None:
        out_NX = out_bsx.reshape(b * s, out_bsx.shape[-1]).to(stats_dtype)
        rows = "bs"
    elif out_bsx.is_contiguous():
        out_NX = out_bsx.reshape(b * s, out_bsx.shape[-1])
        rows = "bs"
    else:
        out_NX = output_tensor.reshape(s * b, output_tensor.shape[-1])
        rows = "sb"

    def flat(name: str) -> torch.Tensor:
        t = getattr(batch, name)
        if rows == "sb":
            t = t.transpose(0, 1)
        return t.reshape(b * s, *t.shape[2:])

    f = {name: flat(name) for name in _FIELDS}
    # Checked once where the rollouts entered (batch.validated): no checks, no host syncs here.
    check = not bool(getattr(batch, "validated", False))
    args = (f["labels"], f["support_ids"], f["support_logprobs"], f["support_valid"])
    kw = dict(tp_group=group, vocab_size=batch_vocab_size(batch),
              temperature=float(batch.temperature), validate=check)
    if head is None:
        stats = token_stats(out_NX, *args, inplace=inplace, **kw)
    else:
        # hidden out_NX [N, H] x weight [V_local, H]: the [N, V_local] logits are never formed.
        weight_VH = head.weight() if stats_dtype is None else head.weight().to(stats_dtype)
        stats = fused_token_stats(out_NX, weight_VH, *args, token_chunk=head.token_chunk,
                                  vocab_chunk=head.vocab_chunk, **kw)
    return BatchStats(stats, f, rows, check)


def policy_loss_func(output_tensor: torch.Tensor, *, batch: Any, cfg: PolicyLossConfig,
                     layout: str = "auto", tp_group: Any = "parallel_state",
                     inplace: bool = True, head: Any = None):
    """megatron-core loss_func: PDM/DPPO/GRPO/DRPO policy loss on vocab-parallel logits.

    Args:
        output_tensor: logits `[b, s, Vl]` or `[s, b, Vl]` (this TP rank's vocab shard); with
            `head`, the final hidden states `[b, s, H]` or `[s, b, H]`.
        batch: a `PackedBatch`, padded `[b, s]` or THD `[1, total]`; its `temperature`,
            `vocab_size` and `validated` are used as recorded by the rollout engine.
        cfg: the loss config (preset).
        layout: see `to_bsv`.
        tp_group: process group; default: megatron's TP group (None when TP == 1).
        inplace: let the op work in the logits' storage (fp32 logits; see `token_stats`).
        head: the model's `LMHead` when it was built with the fused head (see
            `batch_token_stats`), else None.

    Returns:
        (loss_sum, num_tokens int tensor, metrics {key: tensor([sum, count])}).
    """
    # inplace: fp32 logits are consumed like megatron's CE consumes them (exp kept in their
    # storage for backward, gradient written there); nothing else reads the logits afterwards.
    out = batch_token_stats(output_tensor, batch, layout=layout, tp_group=tp_group,
                            inplace=inplace, head=head)
    f = out.fields
    mask_N = f["loss_mask"].to(torch.bool)
    loss_sum, num_tokens, metrics = policy_loss(
        out.stats, f["advantages"], f["behavior_logprob"], mask_N, cfg, seq_ids=f["seq_ids"],
        check_inputs=out.checked)
    metrics = dict(metrics)
    metrics[M.TOKENS_LOSS] = M.sum_count(mask_N.double(), mask_N, torch.float64)
    return loss_sum, num_tokens.reshape(()), metrics


def make_loss_func(batch: Any, cfg: PolicyLossConfig, *, layout: str = "auto",
                   inplace: bool = True, head: Any = None):
    """Binds a micro-batch: returns `loss_func(output_tensor)` for a megatron forward_step.
    `head`: `lm_head_of(model)` (mcore/lm_head.py): None for megatron's own output layer."""
    return functools.partial(policy_loss_func, batch=batch, cfg=cfg, layout=layout,
                             inplace=inplace, head=head)
