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

(the buffer passes of the default paths are row chunks of at most `chunk_elems` elements).

Backward is the cross-entropy backward of the sampled token only:
d log pi_k / d logits = (onehot_k - softmax) / temperature, local to each shard. Every other
statistic is detached. The masked columns get their exact values from log space: -g pi_i / T on
the support and g (1 - pi_k) / T = g e^{log Z_-k - log Z} / T on k (no 1 - pi_k cancellation).

Memory: by default the op saves the logits tensor by reference (no copy) plus [N, S] vectors, and
*recomputes* the softmax chunk by chunk in backward instead of keeping an fp32 [N, Vl] softmax.
Forward uses one reusable fp32 row-chunk buffer of at most `chunk_elems` elements (default 2^24 =
64 MiB); the only full-size allocation is the gradient, in the logits' dtype. The masking of the
caller's logits during forward is undone bit-exactly before forward returns (through `.data`, so
autograd's version counter is not bumped). `inplace=True` (fp32/fp64; what the Megatron adapter
uses) works in the logits' storage like Megatron's CE: forward leaves exp(z/T - t) there (0 on the
masked columns) and backward turns it into the gradient with one scaling pass and a scatter of
the masked columns, so there is no [N, Vl] allocation and a single exp pass.

No host synchronisation: with validate=False neither forward nor backward reads tensor data on
the host (no nonzero, no boolean indexing, no .item(); tests/unit/test_no_host_sync.py).

Padding: ids >= vocab_size form a suffix of the padded range; each shard slices its real prefix
(parallel/shards.py), so padded logits never enter a sum and no masked copy is made.
Temperature: the tempered logits z/T are formed inside the passes (the caller's logits are not
modified by the default path).

Shape legend: N tokens, Vl local vocab shard (padded), S support slots, M = S + 1 masked slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_pdm.ops.stats import (
    TokenStats,
    assemble_token_stats,
    exp_shift,
    is_sampled_slot,
    log_sums,
)
from megatron_pdm.ops.validation import check_token_args, check_vocab_size, validate_token_inputs
from megatron_pdm.parallel.shards import ShardInfo, owned_support, shard_info

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "NUM_SUM_EXTRA",
    "MaskedColumns",
    "mask_columns",
    "masked_columns",
    "pack_sums",
    "restore_columns",
    "shard_logprob_grad",
    "shard_tail_max",
    "shard_tail_sums",
    "token_stats",
]

DEFAULT_CHUNK_ELEMS = 1 << 24
"""Row chunks of the default paths' fp32 working buffer hold at most this many elements (64 MiB).
Fewer, larger chunks keep the per-op thread barriers of CPU kernels rare."""

NUM_SUM_EXTRA = 3
"""Columns after z_S in the packed SUM: z_k, Z_T, S2_T."""


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    """The single door for collectives (tests patch it to count calls). No-op for world size 1."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    dist.all_reduce(t, op=op, group=group)
    return t


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(n_rows: int, n_cols: int, chunk_elems: int):
    step = max(1, chunk_elems // max(n_cols, 1))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


@dataclass(frozen=True)
class MaskedColumns:
    """The columns of one shard that the op handles in log space, [N, M] with M = S + 1:
    the support slots, then the sampled token.

    Attributes:
        idx_NM: int64 local column (0 where the slot is not owned by this shard).
        owned_NM: bool, the slot is valid (support) and its id lies in this shard's real range.
        z_NM: the logits at idx_NM before masking (logits' dtype; any value where not owned).
    """

    idx_NM: torch.Tensor
    owned_NM: torch.Tensor
    z_NM: torch.Tensor


def masked_columns(
    logits_NVl: torch.Tensor,
    sampled_ids_N: torch.Tensor,
    support_ids_NS: torch.Tensor,
    support_valid_NS: torch.Tensor,
    shard: ShardInfo,
) -> MaskedColumns:
    """Owned support columns and the sampled column of this shard, with their logits."""
    owned_NS, idx_NS = owned_support(support_ids_NS, support_valid_NS, shard)
    k_local_N = sampled_ids_N.long() - shard.vocab_start
    k_owned_N = (k_local_N >= 0) & (k_local_N < shard.n_real)
    idx_NM = torch.cat([idx_NS, torch.where(k_owned_N, k_local_N, 0)[:, None]], 1)
    owned_NM = torch.cat([owned_NS, k_owned_N[:, None]], 1)
    if shard.n_real == 0 or logits_NVl.shape[0] == 0:
        z_NM = torch.zeros(idx_NM.shape, dtype=logits_NVl.dtype, device=logits_NVl.device)
    else:
        z_NM = logits_NVl[:, : shard.n_real].gather(1, idx_NM)
    return MaskedColumns(idx_NM, owned_NM, z_NM)


def _write_columns(real_NV: torch.Tensor, cols: MaskedColumns, src_NM: torch.Tensor) -> None:
    """real[row, idx[row, m]] = src[row, m]; callers make all writes to one column agree, so the
    result does not depend on the write order (CPU or GPU). fp32/fp64 use scatter_; bf16/fp16
    use index_put_ (CPU scatter_ on reduced-precision dtypes copies the whole tensor)."""
    if real_NV.shape[1] == 0 or real_NV.shape[0] == 0:
        return
    if real_NV.dtype in (torch.float32, torch.float64):
        real_NV.scatter_(1, cols.idx_NM, src_NM)
    else:
        rows_NM = torch.arange(real_NV.shape[0], device=real_NV.device)[:, None].expand_as(
            cols.idx_NM)
        real_NV.index_put_((rows_NM, cols.idx_NM), src_NM)


def mask_columns(real_NV: torch.Tensor, cols: MaskedColumns) -> None:
    """Sets the owned masked columns of the real shard to -inf, in place.

    Slots that are not owned point at column 0; they write column 0's own value (its gathered
    original, or -inf when column 0 is itself masked in that row), so duplicate targets agree."""
    col0_masked_N1 = (cols.owned_NM & (cols.idx_NM == 0)).any(-1, keepdim=True)
    src_NM = cols.z_NM.masked_fill(cols.owned_NM | col0_masked_N1, -torch.inf)
    _write_columns(real_NV, cols, src_NM)


def restore_columns(real_NV: torch.Tensor, cols: MaskedColumns) -> None:
    """Writes the gathered logits back: bit-exact undo of `mask_columns` (every write to a
    column carries that column's original value, so duplicate targets agree)."""
    _write_columns(real_NV, cols, cols.z_NM)


def shard_tail_max(real_NV: torch.Tensor, temperature: float, work: torch.dtype) -> torch.Tensor:
    """Local max of the tempered logits outside the masked columns ([N], -inf if none).

    One read pass on the logits' own dtype (max commutes with the monotone cast and /T)."""
    n = real_NV.shape[0]
    if real_NV.shape[1] == 0 or n == 0:
        return torch.full((n,), -torch.inf, dtype=work, device=real_NV.device)
    return real_NV.amax(-1).to(work) / temperature


def _exp_shifted_(dst_RV: torch.Tensor, src_RV: torch.Tensor, shift_R: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """dst = exp(src / T - shift) in the working dtype: 2 passes (a fused shift, then exp_).

    bf16/fp16 sources are cast by a plain copy first: mixed-dtype arithmetic is several times
    slower on CPU. `dst` may be `src` (in-place mode)."""
    same = dst_RV.data_ptr() == src_RV.data_ptr()
    if src_RV.dtype != dst_RV.dtype:
        dst_RV.copy_(src_RV)
        src_RV, same = dst_RV, True
    if temperature == 1.0:
        if same:
            dst_RV.sub_(shift_R[:, None])
        else:
            torch.sub(src_RV, shift_R[:, None], out=dst_RV)
    else:  # z * (1/T) - shift in one pass
        torch.add(-shift_R[:, None], src_RV, alpha=1.0 / temperature, out=dst_RV)
    return dst_RV.exp_()


def shard_tail_sums(
    real_NV: torch.Tensor,
    shift_N: torch.Tensor,
    temperature: float,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    in_storage: bool = False,
) -> torch.Tensor:
    """Local exact tail sums relative to the global shift: [N, 2] = (Z_T, S2_T).

    `real_NV` has its masked columns at -inf (they contribute e^-inf = 0). With `in_storage`
    (the logits already in the working dtype, in-place mode) e = exp(z/T - shift) is computed in
    the logits' own storage and left there for backward, in one pass over all rows; otherwise a
    reusable fp32 row-chunk buffer holds it.
    """
    work = shift_N.dtype
    n, v = real_NV.shape
    out_N2 = torch.zeros((n, 2), dtype=work, device=real_NV.device)
    if v == 0 or n == 0:
        return out_N2
    if in_storage:
        e_NV = _exp_shifted_(real_NV, real_NV, shift_N, temperature)
        out_N2[:, 0] = e_NV.sum(-1)
        # sum of squares in one read pass (no squared temporary)
        out_N2[:, 1] = torch.linalg.vector_norm(e_NV, 2, -1).square_()
        return out_N2
    buf = None
    for r0, r1 in _chunks(n, v, chunk_elems):
        if buf is None:  # the only [rows, Vl] temporary, reused by every chunk
            buf = torch.empty((r1 - r0, v), dtype=work, device=real_NV.device)
        e_RV = _exp_shifted_(buf[: r1 - r0], real_NV[r0:r1], shift_N[r0:r1], temperature)
        out_N2[r0:r1, 0] = e_RV.sum(-1)
        out_N2[r0:r1, 1] = torch.linalg.vector_norm(e_RV, 2, -1).square_()
    return out_N2


def pack_sums(cols: MaskedColumns, tail_sums_N2: torch.Tensor, temperature: float
              ) -> torch.Tensor:
    """The SUM all-reduce payload [N, S + 3]: z_S | z_k (tempered, owner's value, else 0) |
    Z_T | S2_T (this shard's partial sums)."""
    z_NM = torch.where(cols.owned_NM, cols.z_NM.to(tail_sums_N2.dtype) / temperature, 0.0)
    return torch.cat([z_NM, tail_sums_N2], 1)


def shard_logprob_grad(
    logits_NVl: torch.Tensor,
    cols_idx_NM: torch.Tensor,
    cols_owned_NM: torch.Tensor,
    is_sampled_NS: torch.Tensor,
    grad_N: torch.Tensor,
    ref_N: torch.Tensor,
    tail_rel_N: torch.Tensor,
    log_z_N: torch.Tensor,
    log_z_not_k_N: torch.Tensor,
    support_rel_NS: torch.Tensor,
    shard: ShardInfo,
    temperature: float,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    in_storage: bool = False,
) -> torch.Tensor:
    """Local gradient of sum_t grad_t * log pi_k(t): grad/T * (onehot_k - softmax), padding 0.

    Args:
        logits_NVl: the saved logits; with `in_storage` their real columns hold
            e = exp(z/T - t) (t the tail max) with 0 on the masked columns (left by forward).
        cols_idx_NM, cols_owned_NM: `MaskedColumns.idx_NM` / `.owned_NM`.
        is_sampled_NS: the slot of the sampled token.
        grad_N: upstream gradient of log pi_k.
        ref_N, tail_rel_N, log_z_N, log_z_not_k_N, support_rel_NS: `LogSums` fields (relative
            to the row max ref, so every factor below is <= 1: nothing overflows).
        shard, temperature, chunk_elems: as forward.
        in_storage: gradient written into the logits' storage (one scaling pass + a scatter of
            the masked columns' exact values). Otherwise the softmax is recomputed chunk by chunk
            from the intact logits into the gradient (fp32/fp64) or through a reused fp32 buffer
            (bf16), and the sampled column is overwritten with its exact value.

    Returns:
        [N, Vl] in the logits' dtype.
    """
    work = ref_N.dtype
    n = logits_NVl.shape[0]
    s = is_sampled_NS.shape[1]
    out_NVl = logits_NVl if in_storage else torch.empty_like(
        logits_NVl, memory_format=torch.contiguous_format)
    out_NVl[:, shard.n_real:].zero_()
    if shard.n_real == 0 or n == 0:
        return out_NVl
    scale_N = grad_N.to(work) / temperature
    # the sampled column's exact value g/T (1 - pi_k) from the complement (no cancellation)
    val_k_N = torch.where(cols_owned_NM[:, s], scale_N * torch.exp(log_z_not_k_N - log_z_N), 0.0)
    real_NV = out_NVl[:, : shard.n_real]
    if in_storage:
        # pi_j = e_j * exp(t - ref - log Z_rel): one factor per row, -g/T folded in (0 when the
        # tail is empty: e is 0 everywhere then)
        factor_N = -scale_N * torch.exp(tail_rel_N - log_z_N)
        # masked columns hold 0: add -g/T pi_i on owned support columns (i != k) and the exact
        # k value; the non-owned slots add 0 to column 0 (exact, order-independent).
        other_NS = cols_owned_NM[:, :s] & ~is_sampled_NS
        val_NS = torch.where(other_NS, -scale_N[:, None] * torch.exp(
            support_rel_NS - log_z_N[:, None]), 0.0)
        real_NV.mul_(factor_N[:, None])
        real_NV.scatter_add_(1, cols_idx_NM, torch.cat([val_NS, val_k_N[:, None]], 1)
                             .to(real_NV.dtype))
        return out_NVl
    # softmax = exp(z/T - ref) * exp(-log Z_rel), ref the row max: recomputed, -g/T folded in
    factor_N = -scale_N * torch.exp(-log_z_N)
    direct = logits_NVl.dtype == work
    src_NV = logits_NVl[:, : shard.n_real]
    k_idx_N1 = cols_idx_NM[:, s:]
    buf = None
    for r0, r1 in _chunks(n, shard.n_real, chunk_elems):
        dst_RV = real_NV[r0:r1]
        if direct:
            p_RV = dst_RV
        else:
            if buf is None:
                buf = torch.empty((r1 - r0, shard.n_real), dtype=work, device=logits_NVl.device)
            p_RV = buf[: r1 - r0]
        _exp_shifted_(p_RV, src_NV[r0:r1], ref_N[r0:r1], temperature)
        p_RV.mul_(factor_N[r0:r1, None])
        # one write per row: the exact k value where owned, the value already there elsewhere
        kk_R1 = k_idx_N1[r0:r1]
        keep_R1 = p_RV.gather(1, kk_R1)
        p_RV.scatter_(1, kk_R1, torch.where(cols_owned_NM[r0:r1, s:], val_k_N[r0:r1, None],
                                            keep_R1))
        if not direct:
            dst_RV.copy_(p_RV)
    return out_NVl


def _group_rank_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _VocabParallelTokenStats(torch.autograd.Function):
    """Fused reductions + log pi_k with a CE-style backward. See the module docstring."""

    @staticmethod
    def forward(ctx, logits, sampled_ids, support_ids, support_valid, group, shard, temperature,
                chunk_elems, inplace):
        work = _work_dtype(logits.dtype)
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
                tail_max_N = _all_reduce(tail_max_N, dist.ReduceOp.MAX, group)
                shift_N = exp_shift(tail_max_N)
                sums_N2 = shard_tail_sums(real_NV, shift_N, temperature, chunk_elems,
                                          in_storage=holds_exp)
            finally:
                if not holds_exp:
                    restore_columns(real_NV, cols)
            packed_NP = pack_sums(cols, sums_N2, temperature)
            # Collective 2/2 (SUM of [N, S+3]): z_S, z_k (owner-gathered), Z_T, S2_T.
            packed_NP = _all_reduce(packed_NP, dist.ReduceOp.SUM, group)
            is_k_NS = is_sampled_slot(support_ids, support_valid, sampled_ids)
            ls = log_sums(tail_max_N, packed_NP[:, :s], packed_NP[:, s], packed_NP[:, s + 1],
                          packed_NP[:, s + 2], support_valid, is_k_NS)
            logprob_N = ls.sampled_rel - ls.log_z
        ctx.save_for_backward(src, cols.idx_NM, cols.owned_NM, is_k_NS, ls.ref, ls.tail_rel,
                              ls.log_z, ls.log_z_not_k, ls.support_rel)
        ctx.shard, ctx.temperature, ctx.chunk_elems = shard, temperature, chunk_elems
        ctx.holds_exp = holds_exp
        ctx.mark_non_differentiable(tail_max_N, packed_NP)
        return logprob_N, tail_max_N, packed_NP

    @staticmethod
    def backward(ctx, grad_logprob_N, _grad_max, _grad_sums):
        src, idx_NM, owned_NM, is_k_NS, ref_N, tail_rel_N, log_z_N, log_z_not_k_N, rel_NS = (
            ctx.saved_tensors)
        grad_logits = None
        if ctx.needs_input_grad[0]:
            # No collective: the CE backward is local to each vocab shard.
            grad_logits = shard_logprob_grad(
                src, idx_NM, owned_NM, is_k_NS, grad_logprob_N, ref_N, tail_rel_N, log_z_N,
                log_z_not_k_N, rel_NS, ctx.shard, ctx.temperature, ctx.chunk_elems,
                in_storage=ctx.holds_exp,
            )
        return grad_logits, None, None, None, None, None, None, None, None


def _check_rows(stats: TokenStats, tail_max_N: torch.Tensor, packed_NP: torch.Tensor) -> None:
    """validate=True: NaN / +inf anywhere in a row's real logits, or a row with no finite logit,
    is an error naming the row. The inputs are replicated after the collectives, so every TP
    rank raises together (no hang). One host sync (more only on the error path)."""
    s = stats.support_valid.shape[1]
    z_s, z_k = packed_NP[:, :s], packed_NP[:, s]
    bad_N = torch.isnan(tail_max_N) | (tail_max_N == torch.inf)
    bad_N |= (stats.support_valid & (torch.isnan(z_s) | (z_s == torch.inf))).any(-1)
    bad_N |= torch.isnan(z_k) | (z_k == torch.inf)
    dead_N = ~bad_N & torch.isnan(stats.logprob.detach())
    flags_2N = torch.stack([bad_N, dead_N])
    if bool(flags_2N.any()):
        which, row = (int(i) for i in flags_2N.nonzero()[0])
        if which == 0:
            raise ValueError(f"logits: row {row} has non-finite values (NaN or +inf)")
        raise ValueError(f"logits: row {row} has no finite logit (every real logit is -inf)")


def token_stats(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    support_logprobs: torch.Tensor,
    support_valid: torch.Tensor,
    *,
    tp_group=None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    validate: bool = True,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
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
        tp_group: tensor-parallel process group, or None for a single device.
        vocab_size: engine vocabulary, an int (ids >= vocab_size are padding, excluded from the
            softmax); defaults to Vl * tp_size.
        temperature: sampling temperature; logits are divided by it inside the op.
        validate: check the support values on the host (one copy, a host sync) and, after the
            forward, that no row holds NaN / +inf or only -inf (one more sync). Off: no sync at
            all, and such rows give NaN statistics (megatron's NaN checks see them in the loss
            and the gradient). Shapes, dtypes, vocab_size and temperature are always checked
            (host-side, no tensor data read).
        chunk_elems: bound on the elements of a working chunk (default paths).
        inplace: fp32/fp64 logits only (ignored for bf16/fp16, which need an fp32 working copy
            anyway): like Megatron's CE, forward overwrites the logits' real columns with
            exp(z/T - t) and backward overwrites them with the gradient. One exp pass instead of
            two and no [N, Vl] allocation. The caller's logits are destroyed: use it only when
            nothing else reads them (autograd raises if another node saved them); not with
            retain_graph.

    Returns:
        TokenStats in fp32 (fp64 for fp64 logits); only `.logprob` carries a gradient.

    Raises:
        TypeError: vocab_size is not an integer.
        ValueError: on shape/dtype/vocab mismatches or bad support entries (row and slot named),
            and (validate) on rows with NaN / +inf logits or no finite logit (row named).
    """
    rank, world = _group_rank_world(tp_group)
    check_vocab_size(vocab_size)
    if vocab_size is None:
        vocab_size = logits.shape[-1] * world if logits.dim() == 2 else 0
    vocab_size = int(vocab_size)
    args = (logits, sampled_ids, support_ids, support_logprobs, support_valid)
    if validate:
        validate_token_inputs(*args, vocab_size=vocab_size, tp_size=world,
                              temperature=temperature)
    else:
        check_token_args(*args, vocab_size=vocab_size, tp_size=world, temperature=temperature)
    shard = shard_info(rank, world, logits.shape[1], vocab_size)
    logprob_N, tail_max_N, packed_NP = _VocabParallelTokenStats.apply(
        logits, sampled_ids, support_ids, support_valid, tp_group, shard, float(temperature),
        int(chunk_elems), bool(inplace),
    )
    s = support_ids.shape[1]
    stats = assemble_token_stats(
        logprob_N,
        tail_max_N=tail_max_N,
        support_logits_NS=packed_NP[:, :s],
        sampled_logit_N=packed_NP[:, s],
        tail_sum_exp_N=packed_NP[:, s + 1],
        tail_sum_exp2_N=packed_NP[:, s + 2],
        support_logprobs_NS=support_logprobs,
        support_valid_NS=support_valid,
        support_ids_NS=support_ids,
        sampled_ids_N=sampled_ids,
        vocab_size=vocab_size,
    )
    if validate and logprob_N.numel():
        _check_rows(stats, tail_max_N, packed_NP)
    return stats
