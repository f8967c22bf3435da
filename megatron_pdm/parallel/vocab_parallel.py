"""The vocab-parallel token-statistics op: one cross-entropy's worth of work for the whole family.

Every method of the trust-region family (GRPO clip, DPPO, PDM, DRPO) needs log pi_k of the sampled
token with a gradient, and the Top-K/PDM variants also need pi on the rollout support, the tail
mass, P2 and a few exact complements. All of these are per-row reductions over the vocabulary, so
on Megatron's vocab-sharded logits they cost the same two small collectives that a vocab-parallel
cross-entropy already pays, provided they are fused (docs/math.md §5.1):

    forward, collective 1/2: all_reduce MAX of [N]      = tail max t of the tempered logits
    forward, collective 2/2: all_reduce SUM of [N, S+3] = (z_S | z_k | Z_T | S2_T)
    backward: no collective

The "masked columns" of a row are its valid support ids and the sampled token k. They are handled
from their gathered logits, in log space, and masked to -inf in the shard for the two passes over
it. Then one amax gives the tail max t, and one exp pass relative to t gives the exact tail sums
Z_T = sum_{j not in S+k} e^{z_j - t} and S2_T = sum e^{2(z_j - t)} (e^-inf = 0: no cancellation,
no zeroing pass, no rows to rescan when the row maximum is a support column, which on RL inputs
it nearly always is). z_S and z_k are owner-gathered (0 on other ranks). ops/stats.py combines
them in log space: log Z_-k = logsumexp(log Z_T, z_S\\k - t), log Z = logaddexp(log Z_-k, z_k - t),
so log(1 - pi_k) is exact however dominant the sampled token, and nothing under- or overflows.
Full-vocab logits are never gathered.

Passes over the [N, V_l] shard (R read, W write), per path:

    CE (megatron, fp32)   max R | sub RW | exp RW | sum R | div RW || bwd mul RW   = 6R 4W
    inplace=True (fp32)   amax R | sub RW | exp RW | sum R | norm R || bwd mul RW  = 6R 3W
    default fp32          amax R | sub R+W(buf) | exp RW | sum R | norm R
                          || bwd sub R+W | exp RW | mul RW                          = 9R 6W
    bf16 (default)        amax R2 | copy R2+W4 (buf) | sub | exp | sum | norm
                          || bwd copy | sub | exp | mul | copy to bf16

(the forward's shift/exp/sum/norm and the backward's passes go row chunk by row chunk, at most
`chunk_elems` elements each: on a CPU running one thread 2^20, so the passes of one chunk run in
the cache and the bf16 upcast is a cache-resident copy; CE's fresh fp32 copy of the whole shard is
what costs it most on a CPU, page faults included; on a CPU running more threads 2^22, a buffer
malloc reuses and few parallel regions; on an accelerator 2^24, few large kernels).

Backward is the cross-entropy backward of the sampled token only:
d log pi_k / d logits = (onehot_k - softmax) / temperature, local to each shard. Every other
statistic is detached. The masked columns get their exact values from log space: -g pi_i / T on
the support and g (1 - pi_k) / T = g e^{log Z_-k - log Z} / T on k (no 1 - pi_k cancellation).

Memory: by default the op saves the logits tensor by reference (no copy) plus [N, S] vectors, and
*recomputes* the softmax chunk by chunk in backward instead of keeping an fp32 [N, Vl] softmax.
Forward uses one reusable fp32 row-chunk buffer of at most `chunk_elems` elements (default 2^20
= 4 MiB on a one-thread CPU, 2^22 = 16 MiB with more threads, 2^24 = 64 MiB on an accelerator); the only full-size allocation is the gradient, in the logits' dtype. The masking of the
caller's logits during forward is undone bit-exactly before forward returns (through `.data`, so
autograd's version counter is not bumped). `inplace=True` (fp32/fp64; what the Megatron adapter
uses) works in the logits' storage like Megatron's CE: forward leaves exp(z/T - t) there (0 on the
masked columns) and backward turns it into the gradient with one scaling pass and a scatter of
the masked columns, so there is no [N, Vl] allocation and a single exp pass.

No host synchronisation: with validate=False neither forward nor backward reads tensor data on
the host (no nonzero, no boolean indexing, no .item(); tests/ops/test_no_host_sync.py).

Padding: ids >= vocab_size form a suffix of the padded range; each shard slices its real prefix
(parallel/shards.py), so padded logits never enter a sum and no masked copy is made.
Temperature: the tempered logits z/T are formed inside the passes (the caller's logits are not
modified by the default path).

The per-shard math (masking, the passes, the local backward) lives in parallel/shard_math.py;
this module holds the autograd op, its two collectives (through parallel/collectives.py, shared
with the fused LM head) and the public `token_stats`.

Shape legend: N tokens, Vl local vocab shard (padded), S support slots, M = S + 1 masked slots.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pdm.ops.stats import TokenStats, exp_shift, is_sampled_slot, log_sums
from megatron_pdm.parallel.collectives import all_reduce
from megatron_pdm.parallel.contract import close_call, open_call
from megatron_pdm.parallel.shard_math import (
    GradRows,
    grad_in_storage,
    grad_recomputed,
    mask_columns,
    masked_columns,
    pack_sums,
    restore_columns,
    shard_tail_max,
    shard_tail_sums,
    work_dtype,
)

__all__ = ["token_stats"]


class _VocabParallelTokenStats(torch.autograd.Function):
    """Fused reductions + log pi_k with a CE-style backward. See the module docstring.

    Outputs: logprob [N] (differentiable), then, non-differentiable, the reduced tail max [N],
    the reduced SUM payload [N, S+3], the sampled slot [N, S] and the `LogSums` tensors (in
    field order), which `assemble_token_stats` uses as they are.
    """

    @staticmethod
    def forward(ctx, logits, sampled_ids, support_ids, support_valid, group, shard, temperature,
                chunk_elems, inplace):
        work = work_dtype(logits.dtype)
        # In-place mode keeps exp(z/T - t) in the logits' storage for backward (one exp pass).
        holds_exp = bool(inplace) and logits.dtype == work
        s = support_ids.shape[1]
        with torch.no_grad():
            src = logits
            if not holds_exp and torch._debug_has_internal_overlap(logits) == 1:
                src = logits.detach().contiguous()  # an expanded tensor: mask a private copy
            cols = masked_columns(src, sampled_ids, support_ids, support_valid, shard)
            # The default path masks the caller's logits only for the two passes and restores
            # them bit-exactly; `.data` keeps autograd's version counter out of it.
            real_NV = (src if holds_exp else src.data)[:, : shard.n_real]
            mask_columns(real_NV, cols)
            try:
                tail_max_N = shard_tail_max(real_NV, temperature, work)
                # Collective 1/2 (MAX of [N]): the global tail max, the shift of every exp.
                tail_max_N = all_reduce(tail_max_N, dist.ReduceOp.MAX, group)
                shift_N = exp_shift(tail_max_N)
                sums_N2 = shard_tail_sums(real_NV, shift_N, temperature, chunk_elems,
                                          in_storage=holds_exp)
            finally:
                if not holds_exp:
                    restore_columns(real_NV, cols)
            packed_NP = pack_sums(cols, sums_N2, temperature)
            # Collective 2/2 (SUM of [N, S+3]): z_S, z_k (owner-gathered), Z_T, S2_T.
            packed_NP = all_reduce(packed_NP, dist.ReduceOp.SUM, group)
            # Everything below is replicated across the TP group: no more communication.
            is_k_NS = is_sampled_slot(support_ids, support_valid, sampled_ids)
            ls = log_sums(tail_max_N, packed_NP[:, :s], packed_NP[:, s], packed_NP[:, s + 1],
                          packed_NP[:, s + 2], support_valid, is_k_NS)
            logprob_N = ls.sampled_rel - ls.log_z
        ctx.save_for_backward(src, *GradRows.of(cols, is_k_NS, ls).tensors())
        ctx.shard, ctx.temperature, ctx.chunk_elems = shard, temperature, chunk_elems
        ctx.holds_exp = holds_exp
        sums = (ls.ref, ls.tail_rel, ls.support_rel, ls.sampled_rel, ls.log_z, ls.log_z_not_k,
                ls.log_tail, ls.log_tail2, ls.log_s2_not_k)
        ctx.mark_non_differentiable(tail_max_N, packed_NP, is_k_NS, *sums)
        return (logprob_N, tail_max_N, packed_NP, is_k_NS, *sums)

    @staticmethod
    def backward(ctx, grad_logprob_N, *_grads_of_detached):
        src, *saved = ctx.saved_tensors
        rows = GradRows(*saved)
        grad_logits = None
        if ctx.needs_input_grad[0]:
            # No collective: the CE backward is local to each vocab shard.
            if ctx.holds_exp:
                grad_logits = grad_in_storage(src, rows, grad_logprob_N, shard=ctx.shard,
                                              temperature=ctx.temperature)
            else:
                grad_logits = grad_recomputed(src, rows, grad_logprob_N, shard=ctx.shard,
                                              temperature=ctx.temperature,
                                              chunk_elems=ctx.chunk_elems)
        return grad_logits, None, None, None, None, None, None, None, None


def token_stats(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    support_logprobs: torch.Tensor,
    support_valid: torch.Tensor,
    *,
    tp_group,
    vocab_size: int | None,
    temperature: float = 1.0,
    validate: bool = True,
    chunk_elems: int | None = None,
    inplace: bool = False,
) -> TokenStats:
    """Per-token statistics of the training policy against the rollout support, vocab-parallel.

    Collective budget: forward 2 all-reduces on `tp_group` (one MAX of [N], one SUM of
    [N, S+3]); backward none; no collective at all when `tp_group` is None or has size 1.
    Memory: saved logits by reference + [N, S] vectors; row-chunked fp32 temporaries of at most
    `chunk_elems` elements; backward allocates the gradient in the logits' dtype (none in place).
    Host syncs: none with validate=False.

    Args:
        logits: [N, Vl] this rank's contiguous shard of the padded vocabulary (full vocabulary
            when tp_group is None); fp32, bf16, fp16 or fp64. Rank r owns ids [r*Vl, (r+1)*Vl).
            -inf marks a token the policy cannot emit (docs/math.md §6.10).
        sampled_ids: [N] global ids of the sampled tokens (replicated across TP).
        support_ids: [N, S] int32/int64 global ids: rollout top-K plus the sampled token, folded
            in once (replicated).
        support_logprobs: [N, S] fp32 behavior log-probabilities on the support (tempered).
        support_valid: [N, S] bool; invalid slots are ignored. The sampled token must be a valid
            entry on every row that has any valid slot.
        tp_group: required keyword: the tensor-parallel process group `logits` is sharded
            over, or None for a single device (the logits hold the whole padded vocabulary).
            There is no default: a shard normalised as if it were the whole vocabulary gives
            plausible, wrong statistics, so the caller says which it is.
        vocab_size: required keyword: the engine vocabulary, an int (ids >= vocab_size are
            padding, excluded from the softmax), or None when the logits carry no padding at
            all, which only a single device can vouch for: None means vocab_size = Vl, and is
            refused when `tp_group` has more than one rank (Megatron pads the vocabulary it
            shards; pass the engine's size there).
        temperature: sampling temperature; logits are divided by it inside the op.
        validate: check the support values on the host (one copy, a host sync) and, after the
            forward, that no row holds NaN / +inf or only -inf (one more sync). Off: no sync at
            all, and such rows give NaN statistics (megatron's NaN checks see them in the loss
            and the gradient). Shapes, dtypes, vocab_size and temperature are always checked
            (host-side, no tensor data read).
        chunk_elems: bound on the elements of a row chunk (the fp32 working buffer of the
            default paths; the exp pass of the in-place path); None: `default_chunk_elems` of
            the logits' device (parallel/shard_math.py: 2^20 on a CPU running one thread,
            2^22 with more threads, 2^24 on an accelerator with the in-place exp pass
            unchunked).
        inplace: fp32/fp64 logits only (ignored for bf16/fp16, which need an fp32 working copy
            anyway): like Megatron's CE, forward overwrites the logits' real columns with
            exp(z/T - t) and backward overwrites them with the gradient. One exp pass instead of
            two and no [N, Vl] allocation. The caller's logits are destroyed: use it only when
            nothing else reads them (autograd raises if another node saved them); not with
            retain_graph.

    Returns:
        TokenStats in fp32 (fp64 for fp64 logits); only `.logprob` carries a gradient.

    Raises:
        TypeError: tp_group or vocab_size left out (they have no default); vocab_size is
            neither an integer nor None.
        ValueError: vocab_size None on more than one TP rank; on shape/dtype/vocab mismatches
            or bad support entries (row and slot named),
            and (validate) on rows with NaN / +inf logits or no finite logit (row named).
    """
    vocab_size, shard = open_call(logits, sampled_ids, support_ids, support_logprobs,
                                  support_valid, tp_group=tp_group, vocab_size=vocab_size,
                                  temperature=temperature, validate=validate)
    logprob_N, tail_max_N, packed_NP, is_k_NS, *sums = _VocabParallelTokenStats.apply(
        logits, sampled_ids, support_ids, support_valid, tp_group, shard, float(temperature),
        None if chunk_elems is None else int(chunk_elems), bool(inplace),
    )
    return close_call(logprob_N, sums, tail_max_N, packed_NP, is_k_NS,
                      support_ids_NS=support_ids, support_logprobs_NS=support_logprobs,
                      support_valid_NS=support_valid, vocab_size=vocab_size, validate=validate)
