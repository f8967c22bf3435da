"""The fused LM head + token statistics: `token_stats` of `hidden @ weight.T` without the logits.

`fused_token_stats(hidden_nh, weight_vh, ...)` returns the same `TokenStats` as
`token_stats(hidden_nh @ weight_vh.T, ...)` (parallel/vocab_parallel.py), but the [N, Vl] logits
never exist: they are computed one [token_chunk, vocab_chunk] chunk at a time, reduced, and
dropped; backward recomputes each chunk and accumulates the gradients of the hidden states and
of this rank's weight shard. Peak extra memory is one chunk (plus its fp32 working copy for
bf16/fp16) and O(N * S) vectors, whatever the vocabulary (tests/parallel/test_fused_head.py).

Forward, per token chunk, streaming over the vocabulary chunks of this shard (online
log-sum-exp, relative to a running max m):

    per vocab chunk   z = h @ W_c.T; owned support/sampled columns gathered, then -inf
                      (shard_math.masked_columns / mask_columns on the chunk as a sub-shard)
                      chunk max c (shard_math.shard_tail_max); m' = max(m, c)
                      (Z_T, S2_T) <- (Z_T, S2_T) * (e^{m - m'}, e^{2(m - m')}) + chunk sums
                      relative to m' (shard_math.shard_tail_sums)
    collective 1/2    all_reduce MAX of [N]: the global tail max t; local sums rescaled to t
    collective 2/2    all_reduce SUM of [N, S+3] (shard_math.pack_sums): z_S | z_k | Z_T | S2_T

then `log_sums` and `assemble_token_stats` exactly as the unfused op (ops/stats.py): one rule in
one place. The per-chunk math is the unfused op's per-shard math applied to a chunk: a vocab
chunk [c0, c1) of shard r is a sub-shard with vocab_start = r * Vl + c0 and its own real prefix,
so padding ids (>= vocab_size) never enter a sum and padded weight rows get a zero gradient.

Backward (no collective): per (token, vocab) chunk, the logits are recomputed and
`shard_math.grad_recomputed` gives d/dz = g/T (onehot_k - softmax) for the chunk (the same
function as the unfused op's default backward); then grad_h += dz @ W_c and grad_W_c += dz.T @ h.
The gradients of bf16/fp16 inputs accumulate in fp32 and are cast once at the end.

Tensor/sequence parallelism of the LM head itself (gathering hidden states across a sequence
parallel group, or the all-reduce of grad_h over the TP group that Megatron's ColumnParallelLinear
does) is the caller's: this op sees this rank's hidden states [N, H] (all N tokens) and weight
shard, and returns this rank's partial grad_h (the sum over TP ranks is the full gradient, as for
any column-parallel linear).

Shape legend: N tokens, H hidden, Vl local vocab shard (padded), R rows of a token chunk, C
columns of a vocab chunk, S support slots, M = S + 1 masked slots.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_pdm.ops.stats import TokenStats, exp_shift, is_sampled_slot, log_sums
from megatron_pdm.parallel.collectives import all_reduce
from megatron_pdm.parallel.contract import close_call, open_call
from megatron_pdm.parallel.shard_math import (
    GradRows,
    MaskedColumns,
    grad_recomputed,
    mask_columns,
    masked_columns,
    pack_sums,
    shard_tail_max,
    shard_tail_sums,
    work_dtype,
)
from megatron_pdm.parallel.shards import ShardInfo

__all__ = ["DEFAULT_TOKEN_CHUNK", "DEFAULT_VOCAB_CHUNK", "fused_token_stats"]

DEFAULT_TOKEN_CHUNK = 1024
"""Rows of a logits chunk (chosen by measurement: docs/op.md, "Fused LM head")."""
DEFAULT_VOCAB_CHUNK = 4096
"""Columns of a logits chunk: one chunk is 4M elements (16 MiB in fp32)."""


def _chunk_shard(shard: ShardInfo, c0: int, c1: int) -> ShardInfo:
    """Vocab columns [c0, c1) of `shard` as a sub-shard: its own start and real prefix."""
    return ShardInfo(shard.rank, shard.world, c1 - c0, shard.vocab_start + c0,
                     max(0, min(c1 - c0, shard.n_real - c0)))


def _spans(n: int, step: int):
    for a in range(0, n, step):
        yield a, min(n, a + step)


def _forward_sums(hidden, weight, sampled_ids, support_ids, support_valid, shard, temperature,
                  token_chunk, vocab_chunk, work):
    """Local streaming reductions of this shard: (tail max m [N], (Z_T, S2_T) [N, 2] relative
    to exp_shift(m), the owned masked columns: owned [N, M], their untempered logits z [N, M]
    in the working dtype, 0 where not owned)."""
    n, m_slots = hidden.shape[0], support_ids.shape[1] + 1
    dev = hidden.device
    max_N = torch.full((n,), -torch.inf, dtype=work, device=dev)
    sums_N2 = torch.zeros((n, 2), dtype=work, device=dev)
    owned_NM = torch.zeros((n, m_slots), dtype=torch.bool, device=dev)
    z_NM = torch.zeros((n, m_slots), dtype=work, device=dev)
    for r0, r1 in _spans(n, token_chunk):
        h_RH = hidden[r0:r1]
        ids_R, sup_RS, val_RS = sampled_ids[r0:r1], support_ids[r0:r1], support_valid[r0:r1]
        m_R, s_R2 = max_N[r0:r1], sums_N2[r0:r1]
        for c0, c1 in _spans(shard.n_real, vocab_chunk):  # padding columns are never computed
            sub = _chunk_shard(shard, c0, c1)
            z_RC = torch.mm(h_RH, weight[c0:c1].t())  # the only [R, C] logits chunk
            cols = masked_columns(z_RC, ids_R, sup_RS, val_RS, sub)
            owned_NM[r0:r1] |= cols.owned_NM
            z_NM[r0:r1] += torch.where(cols.owned_NM, cols.z_NM.to(work), 0.0)
            mask_columns(z_RC, cols)
            new_m_R = torch.maximum(m_R, shard_tail_max(z_RC, temperature, work))
            new_shift_R = exp_shift(new_m_R)
            # online log-sum-exp: rescale the running sums to the new max (0 while empty)
            f_R = torch.where(m_R == -torch.inf, 0.0, torch.exp(exp_shift(m_R) - new_shift_R))
            chunk_R2 = shard_tail_sums(z_RC, new_shift_R, temperature, chunk_elems=z_RC.numel(),
                                       in_storage=z_RC.dtype == work)
            s_R2.mul_(torch.stack([f_R, f_R * f_R], 1)).add_(chunk_R2)
            m_R.copy_(new_m_R)
    return max_N, sums_N2, owned_NM, z_NM


class _FusedHeadTokenStats(torch.autograd.Function):
    """Chunked LM head + the op's fused reductions; outputs as `_VocabParallelTokenStats`."""

    @staticmethod
    def forward(ctx, hidden, weight, sampled_ids, support_ids, support_valid, group, shard,
                temperature, token_chunk, vocab_chunk):
        work = work_dtype(hidden.dtype)
        s = support_ids.shape[1]
        with torch.no_grad():
            local_max_N, sums_N2, owned_NM, z_NM = _forward_sums(
                hidden, weight, sampled_ids, support_ids, support_valid, shard, temperature,
                token_chunk, vocab_chunk, work)
            # Collective 1/2 (MAX of [N]): the global tail max, the shift of every exp.
            tail_max_N = all_reduce(local_max_N.clone(), dist.ReduceOp.MAX, group)
            shift_N = exp_shift(tail_max_N)
            f_N = torch.where(local_max_N == -torch.inf, 0.0,
                              torch.exp(exp_shift(local_max_N) - shift_N))
            sums_N2 = sums_N2 * torch.stack([f_N, f_N * f_N], 1)
            cols = MaskedColumns(torch.zeros_like(owned_NM, dtype=torch.long), owned_NM, z_NM)
            packed_NP = pack_sums(cols, sums_N2, temperature)
            # Collective 2/2 (SUM of [N, S+3]): z_S, z_k (owner-gathered), Z_T, S2_T.
            packed_NP = all_reduce(packed_NP, dist.ReduceOp.SUM, group)
            # Everything below is replicated across the TP group: no more communication.
            is_k_NS = is_sampled_slot(support_ids, support_valid, sampled_ids)
            ls = log_sums(tail_max_N, packed_NP[:, :s], packed_NP[:, s], packed_NP[:, s + 1],
                          packed_NP[:, s + 2], support_valid, is_k_NS)
            logprob_N = ls.sampled_rel - ls.log_z
        rows = GradRows.of(cols, is_k_NS, ls)
        ctx.save_for_backward(hidden, weight, sampled_ids, support_ids, support_valid,
                              *rows.tensors())
        ctx.shard, ctx.temperature = shard, temperature
        ctx.token_chunk, ctx.vocab_chunk = token_chunk, vocab_chunk
        sums = (ls.ref, ls.tail_rel, ls.support_rel, ls.sampled_rel, ls.log_z, ls.log_z_not_k,
                ls.log_tail, ls.log_tail2, ls.log_s2_not_k)
        ctx.mark_non_differentiable(tail_max_N, packed_NP, is_k_NS, *sums)
        return (logprob_N, tail_max_N, packed_NP, is_k_NS, *sums)

    @staticmethod
    def backward(ctx, grad_logprob_N, *_grads_of_detached):
        hidden, weight, sampled_ids, support_ids, support_valid, *saved = ctx.saved_tensors
        rows = GradRows(*saved)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 10
        shard = ctx.shard
        # No collective: the CE backward is local to each vocab shard (grad_h is this rank's
        # partial sum, reduced by the caller's column-parallel linear as usual).
        acc = torch.float32 if hidden.dtype in (torch.bfloat16, torch.float16) else hidden.dtype
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        n = hidden.shape[0]
        for r0, r1 in _spans(n, ctx.token_chunk):
            h_RH = hidden[r0:r1]
            sliced = GradRows(*(t[r0:r1] for t in rows.tensors()))
            g_R = grad_logprob_N[r0:r1]
            for c0, c1 in _spans(shard.n_real, ctx.vocab_chunk):
                sub = _chunk_shard(shard, c0, c1)
                z_RC = torch.mm(h_RH, weight[c0:c1].t())  # recomputed, one chunk
                cols = masked_columns(z_RC, sampled_ids[r0:r1], support_ids[r0:r1],
                                      support_valid[r0:r1], sub)
                chunk_rows = dataclasses.replace(sliced, idx_NM=cols.idx_NM,
                                                 owned_NM=cols.owned_NM)
                dz_RC = grad_recomputed(z_RC, chunk_rows, g_R, shard=sub,
                                        temperature=ctx.temperature, chunk_elems=z_RC.numel())
                if need_h:
                    grad_h[r0:r1] += torch.mm(dz_RC, weight[c0:c1]).to(acc)
                if need_w:
                    grad_w[c0:c1] += torch.mm(dz_RC.t(), h_RH).to(acc)
        grad_h = grad_h.to(hidden.dtype) if need_h else None
        grad_w = grad_w.to(weight.dtype) if need_w else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def _check_head(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden_nh: expected [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight_vh: expected [V_local, H], got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden_nh is {tuple(hidden.shape)}, weight_vh "
                         f"is {tuple(weight.shape)} (both must end in H)")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"dtype mismatch: hidden_nh is {hidden.dtype}, weight_vh is "
                         f"{weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"device mismatch: hidden_nh on {hidden.device}, weight_vh on "
                         f"{weight.device}")


def fused_token_stats(
    hidden_nh: torch.Tensor,
    weight_vh: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    support_logprobs: torch.Tensor,
    support_valid: torch.Tensor,
    *,
    tp_group,
    vocab_size: int | None,
    temperature: float = 1.0,
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    validate: bool = True,
) -> TokenStats:
    """`token_stats(hidden_nh @ weight_vh.T, ...)` without materialising the logits.

    Collective budget: as `token_stats`: forward 2 all-reduces on `tp_group` (MAX of [N], SUM
    of [N, S+3]), backward none. Memory: one [token_chunk, vocab_chunk] logits chunk at a time
    (plus its fp32 copy for bf16/fp16 and the chunk's gradient in backward) and [N, S] vectors;
    backward returns grad_h [N, H] and grad_W [Vl, H] (accumulated in fp32 for bf16/fp16).
    Host syncs: none with validate=False.

    Args:
        hidden_nh: [N, H] the final hidden states (after the final norm); fp32/bf16/fp16/fp64.
        weight_vh: [Vl, H] this rank's shard of the LM-head (output / tied embedding) weight,
            rank r owning global ids [r*Vl, (r+1)*Vl); same dtype and device as hidden_nh.
        sampled_ids, support_ids, support_logprobs, support_valid, tp_group, vocab_size,
            temperature, validate: as `token_stats` (the same support contract, ops/support.py).
        token_chunk, vocab_chunk: the chunk shape (rows x columns of the logits).

    Returns:
        TokenStats in fp32 (fp64 for fp64 inputs); only `.logprob` carries a gradient (to
        hidden_nh and weight_vh).

    Raises:
        TypeError / ValueError: as `token_stats`, plus hidden/weight shape, dtype or device
            mismatches and chunk sizes < 1.
    """
    _check_head(hidden_nh, weight_vh)
    for name, val in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    # The logits' shape and dtype, with no data: the contract's checks read nothing else.
    logits_meta = torch.empty((hidden_nh.shape[0], weight_vh.shape[0]), dtype=hidden_nh.dtype,
                              device="meta")
    vocab_size, shard = open_call(logits_meta, sampled_ids, support_ids, support_logprobs,
                                  support_valid, tp_group=tp_group, vocab_size=vocab_size,
                                  temperature=temperature, validate=validate)
    logprob_N, tail_max_N, packed_NP, is_k_NS, *sums = _FusedHeadTokenStats.apply(
        hidden_nh, weight_vh, sampled_ids, support_ids, support_valid, tp_group, shard,
        float(temperature), int(token_chunk), int(vocab_chunk),
    )
    return close_call(logprob_N, sums, tail_max_N, packed_NP, is_k_NS,
                      support_ids_NS=support_ids, support_logprobs_NS=support_logprobs,
                      support_valid_NS=support_valid, vocab_size=vocab_size, validate=validate)
