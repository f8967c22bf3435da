"""The vocab-parallel token-statistics op: one cross-entropy's worth of work for the whole family.

Every method of the trust-region family (GRPO clip, DPPO, PDM, DRPO) needs log pi_k of the sampled
token with a gradient, and the Top-K/PDM variants also need pi on the rollout support, the tail
mass, P2 and a few exact complements. All of these are per-row reductions over the vocabulary, so
on Megatron's vocab-sharded logits they cost the same two small collectives that a vocab-parallel
cross-entropy already pays, provided they are fused:

    forward, collective 1/2: all_reduce MAX of [N, 2]  = (row max, tail max) of tempered logits
    forward, collective 2/2: all_reduce SUM of [N, S+6] = (z_S | z_k | Z | S2 | Z_T | S2_T | Z_-k)
    backward: no collective

where z_S are the owner-gathered support logits (0 on non-owners), z_k the sampled logit, Z and S2
the sums of e^{z-m} and e^{2(z-m)}, Z_T and S2_T the same sums over the tail j not in S (exact
masked sums, no 1 - sum cancellation), and Z_-k = sum_{j != k} e^{z-m} (§7.3). The MAX must
finish before any exp pass, which is why there are two passes over the shard (§5.1 pitfall).
Full-vocab logits are never gathered.

Backward is the cross-entropy backward of the sampled token only:
d log pi_k / d logits = (onehot_k - softmax) / temperature, local to each shard. Every other
statistic is detached.

Memory (the design choice): by default the op saves the logits tensor by reference (no copy)
plus [N] vectors, and *recomputes* the softmax chunk by chunk in backward instead of keeping an fp32
[N, Vl] softmax like Megatron's CE does. Forward uses one reusable fp32 row-chunk buffer of at
most `chunk_elems` elements (default 2^24 = 64 MiB); the only full-size allocation is the
gradient, in the logits' dtype, which fp32/fp64 backward computes in place of its own storage
(bf16 goes through the chunk buffer). Peak extra memory over the inputs is therefore one
[N, Vl] gradient: for fp32 logits the same as Megatron's CE (which overwrites the logits with the
softmax and that with the gradient), for bf16 logits half of CE's fp32 softmax. The logits must
stay alive until backward (they are saved), which Megatron's CE does not need for fp32 inputs.
`inplace=True` (fp32/fp64; what the Megatron adapter uses) works in the logits' storage like
Megatron's CE: forward leaves exp(z/T - m) there and backward turns it into the gradient with one
scaling pass, so there is no [N, Vl] allocation and a single exp pass. The default (logits kept
intact) pays a second exp pass in backward; benchmarks/bench_op.py measures both.

Padding: ids >= vocab_size form a suffix of the padded range; each shard slices its real prefix
(parallel/shards.py), so padded logits never enter a sum and no masked copy is made.
Temperature: the working chunk is divided by it (the caller's logits are not modified).

Shape legend: N tokens, Vl local vocab shard (padded), S support slots.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pdm.ops.stats import TokenStats, assemble_token_stats
from megatron_pdm.ops.validation import validate_token_inputs
from megatron_pdm.parallel.shards import ShardInfo, owned_support, shard_info

__all__ = [
    "token_stats",
    "shard_max_partials",
    "shard_sum_partials",
    "shard_logprob_grad",
    "DEFAULT_CHUNK_ELEMS",
    "NUM_SUM_EXTRA",
]

DEFAULT_CHUNK_ELEMS = 1 << 24
"""Row chunks are sized so a working fp32 chunk holds at most this many elements (64 MiB).
Fewer, larger chunks keep the per-op thread barriers of CPU kernels rare."""

NUM_SUM_EXTRA = 6
"""Columns after z_S in the packed SUM: z_k, Z, S2, Z_T, S2_T, Z_-k."""


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


def _shifted(src_RV: torch.Tensor, shift_R: torch.Tensor, temperature: float,
             out_RV: torch.Tensor) -> torch.Tensor:
    """out = src / T - shift in the working dtype, one fused pass when dtypes match and T == 1.

    bf16 sources are cast by a plain copy first: mixed-dtype arithmetic is several times slower
    on CPU, and bf16 / python-scalar would divide in bf16 before the cast.
    """
    if temperature == 1.0 and src_RV.dtype == out_RV.dtype:
        if out_RV.data_ptr() == src_RV.data_ptr():
            return out_RV.sub_(shift_R[:, None])
        return torch.sub(src_RV, shift_R[:, None], out=out_RV)
    if out_RV.data_ptr() != src_RV.data_ptr():
        out_RV.copy_(src_RV)
    if temperature != 1.0:
        out_RV.div_(temperature)
    return out_RV.sub_(shift_R[:, None])


def shard_max_partials(
    logits_NVl: torch.Tensor,
    support_ids_NS: torch.Tensor,
    support_valid_NS: torch.Tensor,
    shard: ShardInfo,
    temperature: float,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> torch.Tensor:
    """Local (row max, tail max) of the tempered real logits; -inf where the shard has none.

    The row max is taken on the logits' own dtype (max commutes with the monotone cast and /T),
    without a copy. The tail max excludes owned support columns: rows whose max equals no owned
    support logit reuse the row max; the others (typically few) are recomputed on a copy of just
    those rows with the support columns set to -inf.

    Returns:
        [N, 2] in the working dtype.
    """
    work = _work_dtype(logits_NVl.dtype)
    n = logits_NVl.shape[0]
    out_N2 = torch.full((n, 2), -torch.inf, dtype=work, device=logits_NVl.device)
    if shard.n_real == 0 or n == 0:
        return out_N2
    owned_NS, idx_NS = owned_support(support_ids_NS, support_valid_NS, shard)
    for r0, r1 in _chunks(n, shard.n_real, chunk_elems):
        real_RV = logits_NVl[r0:r1, : shard.n_real]
        vmax_R = real_RV.amax(-1)
        own_RS = owned_NS[r0:r1]
        z_s_RS = real_RV.gather(1, idx_NS[r0:r1])
        hit_RS = own_RS & (z_s_RS == vmax_R[:, None])
        tail_R = vmax_R.to(work, copy=True)
        rows = hit_RS.any(-1).nonzero().squeeze(-1)
        if rows.numel():
            sub_HV = real_RV[rows].to(work)
            own_HS = own_RS[rows]
            h_idx, s_idx = own_HS.nonzero(as_tuple=True)
            sub_HV[h_idx, idx_NS[r0:r1][rows][h_idx, s_idx]] = -torch.inf
            tail_R[rows] = sub_HV.amax(-1)
        out_N2[r0:r1, 0] = vmax_R.to(work) / temperature
        out_N2[r0:r1, 1] = tail_R / temperature
    return out_N2


def shard_sum_partials(
    logits_NVl: torch.Tensor,
    sampled_ids_N: torch.Tensor,
    support_ids_NS: torch.Tensor,
    support_valid_NS: torch.Tensor,
    row_max_N: torch.Tensor,
    shard: ShardInfo,
    temperature: float,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    inplace: bool = False,
) -> torch.Tensor:
    """Local partial sums, relative to the *global* row max, packed for one SUM all-reduce.

    One reusable fp32 chunk buffer holds e = exp(z/T - m) with the owned support columns zeroed,
    so its sums are the exact tail sums Z_T and S2_T; the full sums add the (positive) support
    terms back from the gathered logits: no subtraction of nearly equal numbers anywhere except
    removing e_k on rows whose sampled token is not in the support (padding rows).

    With `inplace` (logits already in the working dtype) the exponentials are computed in the
    logits' own storage instead of the chunk buffer and left there (support columns restored
    bit-exactly), so backward can reuse them without a second exp pass.

    Returns:
        [N, S + 6] working dtype: z_S (owned slots, else 0) | z_k (if owned) | Z | S2 | Z_T |
        S2_T | Z_-k.
    """
    work = row_max_N.dtype
    n, s = support_ids_NS.shape
    out_NP = torch.zeros((n, s + NUM_SUM_EXTRA), dtype=work, device=logits_NVl.device)
    if shard.n_real == 0 or n == 0:
        return out_NP
    owned_NS, idx_NS = owned_support(support_ids_NS, support_valid_NS, shard)
    k_local_N = sampled_ids_N.long() - shard.vocab_start
    k_owned_N = (k_local_N >= 0) & (k_local_N < shard.n_real)
    k_idx_N = torch.where(k_owned_N, k_local_N, 0)
    is_k_NS = support_valid_NS & (support_ids_NS.long() == sampled_ids_N.long()[:, None])
    k_tail_N = k_owned_N & ~is_k_NS.any(-1)
    buf = None
    for r0, r1 in _chunks(n, shard.n_real, chunk_elems):
        real_RV = logits_NVl[r0:r1, : shard.n_real]
        m_R = row_max_N[r0:r1]
        own_RS = owned_NS[r0:r1]
        z_s_RS = torch.where(own_RS, real_RV.gather(1, idx_NS[r0:r1]).to(work) / temperature, 0.0)
        z_k_R = real_RV.gather(1, k_idx_N[r0:r1, None]).squeeze(1).to(work) / temperature
        z_k_R = torch.where(k_owned_N[r0:r1], z_k_R, 0.0)
        if inplace:
            e_RV = _shifted(real_RV, m_R, temperature, real_RV).exp_()
        else:
            if buf is None:  # the only [rows, Vl] temporary, reused by every chunk
                buf = torch.empty((r1 - r0, shard.n_real), dtype=work, device=logits_NVl.device)
            e_RV = _shifted(real_RV, m_R, temperature, buf[: r1 - r0]).exp_()
        r_idx, s_idx = own_RS.nonzero(as_tuple=True)
        c_idx = idx_NS[r0:r1][r_idx, s_idx]
        kept_H = e_RV[r_idx, c_idx] if inplace else None
        e_RV[r_idx, c_idx] = 0.0
        tail_R = e_RV.sum(-1)
        # sum of squares in one read pass (no squared temporary, e stays intact)
        tail2_R = torch.linalg.vector_norm(e_RV, 2, -1).square_()
        if inplace:
            e_RV[r_idx, c_idx] = kept_H  # restore: the storage now holds exp(z/T - m) exactly
        e_s_RS = torch.where(own_RS, torch.exp(z_s_RS - m_R[:, None]), 0.0)
        e_k_R = torch.where(k_tail_N[r0:r1], torch.exp(z_k_R - m_R), 0.0)
        out_NP[r0:r1, :s] = z_s_RS
        out_NP[r0:r1, s] = z_k_R
        out_NP[r0:r1, s + 1] = tail_R + e_s_RS.sum(-1)
        out_NP[r0:r1, s + 2] = tail2_R + (e_s_RS * e_s_RS).sum(-1)
        out_NP[r0:r1, s + 3] = tail_R
        out_NP[r0:r1, s + 4] = tail2_R
        not_k_R = torch.where(is_k_NS[r0:r1], 0.0, e_s_RS).sum(-1)
        out_NP[r0:r1, s + 5] = (tail_R + not_k_R - e_k_R).clamp_min(0.0)
    return out_NP


def shard_logprob_grad(
    logits_NVl: torch.Tensor,
    sampled_ids_N: torch.Tensor,
    grad_N: torch.Tensor,
    row_max_N: torch.Tensor,
    log_z_N: torch.Tensor,
    shard: ShardInfo,
    temperature: float,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    inplace: bool = False,
    holds_exp: bool = False,
) -> torch.Tensor:
    """Local gradient of sum_t grad_t * log pi_k(t): grad/T * (onehot_k - softmax), padding 0.

    The softmax is recomputed chunk by chunk from the saved logits (no saved fp32 softmax).
    fp32/fp64 logits are computed directly in the output; bf16 goes through one reused fp32
    chunk buffer. With `inplace` (fp32/fp64 only) the gradient overwrites the logits' storage,
    as Megatron's CE does with its fp32 input; no [N, Vl] allocation at all. `holds_exp` means
    the forward left exp(z/T - m) in the logits' storage (`token_stats(..., inplace=True)`): the
    gradient is then one in-place scaling of it, with no exp pass.

    Returns:
        [N, Vl] in the logits' dtype.
    """
    work = row_max_N.dtype
    n = logits_NVl.shape[0]
    direct = logits_NVl.dtype == work
    if holds_exp and not (inplace and direct):
        raise AssertionError("holds_exp requires in-place fp32/fp64 logits")
    if inplace and direct:
        out_NVl = logits_NVl
    else:
        out_NVl = torch.empty_like(logits_NVl, memory_format=torch.contiguous_format)
    out_NVl[:, shard.n_real:].zero_()
    if shard.n_real == 0 or n == 0:
        return out_NVl
    scale_N = grad_N.to(work) / temperature
    shift_N = row_max_N + log_z_N
    k_local_N = sampled_ids_N.long() - shard.vocab_start
    k_owned_N = (k_local_N >= 0) & (k_local_N < shard.n_real)
    if holds_exp:
        factor_N = -scale_N * torch.exp(-log_z_N)  # softmax = e / Z
    buf = None
    for r0, r1 in _chunks(n, shard.n_real, chunk_elems):
        dst_RV = out_NVl[r0:r1, : shard.n_real]
        if holds_exp:
            dst_RV.mul_(factor_N[r0:r1, None])
            rows = k_owned_N[r0:r1].nonzero().squeeze(-1)
            dst_RV[rows, k_local_N[r0:r1][rows]] += scale_N[r0:r1][rows]
            continue
        if direct:
            p_RV = dst_RV
        else:
            if buf is None:
                buf = torch.empty((r1 - r0, shard.n_real), dtype=work, device=logits_NVl.device)
            p_RV = buf[: r1 - r0]
        _shifted(logits_NVl[r0:r1, : shard.n_real], shift_N[r0:r1], temperature, p_RV).exp_()
        p_RV.mul_(-scale_N[r0:r1, None])
        rows = k_owned_N[r0:r1].nonzero().squeeze(-1)
        p_RV[rows, k_local_N[r0:r1][rows]] += scale_N[r0:r1][rows]
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
        # In-place mode keeps exp(z/T - m) in the logits' storage for backward (one exp pass).
        holds_exp = bool(inplace) and logits.dtype == _work_dtype(logits.dtype)
        with torch.no_grad():
            max_N2 = shard_max_partials(
                logits, support_ids, support_valid, shard, temperature, chunk_elems
            )
            # Collective 1/2 (MAX): global row max (softmax shift) and global tail max (§7.2).
            max_N2 = _all_reduce(max_N2, dist.ReduceOp.MAX, group)
            sums_NP = shard_sum_partials(
                logits, sampled_ids, support_ids, support_valid, max_N2[:, 0].contiguous(),
                shard, temperature, chunk_elems, inplace=holds_exp,
            )
            # Collective 2/2 (SUM): z_S, z_k, Z, S2, Z_T, S2_T, Z_-k in one packed tensor.
            sums_NP = _all_reduce(sums_NP, dist.ReduceOp.SUM, group)
        s = support_ids.shape[1]
        row_max_N = max_N2[:, 0].contiguous()
        log_z_N = torch.log(sums_NP[:, s + 1])
        logprob_N = sums_NP[:, s] - row_max_N - log_z_N
        ctx.save_for_backward(logits, sampled_ids, row_max_N, log_z_N)
        ctx.shard, ctx.temperature, ctx.chunk_elems = shard, temperature, chunk_elems
        ctx.inplace, ctx.holds_exp = bool(inplace), holds_exp
        ctx.mark_non_differentiable(max_N2, sums_NP)
        return logprob_N, max_N2, sums_NP

    @staticmethod
    def backward(ctx, grad_logprob_N, _grad_max, _grad_sums):
        logits, sampled_ids, row_max_N, log_z_N = ctx.saved_tensors
        grad_logits = None
        if ctx.needs_input_grad[0]:
            # No collective: the CE backward is local to each vocab shard.
            grad_logits = shard_logprob_grad(
                logits, sampled_ids, grad_logprob_N, row_max_N, log_z_N, ctx.shard,
                ctx.temperature, ctx.chunk_elems, ctx.inplace, ctx.holds_exp,
            )
        return grad_logits, None, None, None, None, None, None, None, None


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

    Collective budget: forward 2 all-reduces on `tp_group` (one MAX of [N, 2], one SUM of
    [N, S+6]); backward none; no collective at all when `tp_group` is None or has size 1.
    Memory: saved logits by reference + [N] vectors; row-chunked fp32 temporaries of at most
    `chunk_elems` elements; backward allocates the gradient in the logits' dtype.

    Args:
        logits: [N, Vl] this rank's contiguous shard of the padded vocabulary (full vocabulary
            when tp_group is None); fp32, bf16 or fp64. Rank r owns ids [r*Vl, (r+1)*Vl).
        sampled_ids: [N] global ids of the sampled tokens (replicated across TP).
        support_ids: [N, S] int32/int64 global ids: rollout top-K plus the sampled token, folded
            in once (replicated).
        support_logprobs: [N, S] fp32 behavior log-probabilities on the support (tempered).
        support_valid: [N, S] bool; invalid slots are ignored. The sampled token must be a valid
            entry on every row that has any valid slot.
        tp_group: tensor-parallel process group, or None for a single device.
        vocab_size: engine vocabulary (ids >= vocab_size are padding, excluded from the softmax);
            defaults to Vl * tp_size.
        temperature: sampling temperature; logits are divided by it inside the op.
        validate: run the input checks of ops/validation.py (host syncs, no collectives).
        chunk_elems: bound on the elements of a working chunk.
        inplace: fp32/fp64 logits only (ignored for bf16, which needs an fp32 working copy
            anyway): like Megatron's CE, forward overwrites the logits' real columns with
            exp(z/T - m) and backward overwrites them with the gradient. One exp pass instead of
            two and no [N, Vl] allocation. The caller's logits are destroyed: use it only when
            nothing else reads them (autograd raises if another node saved them); not with
            retain_graph.

    Returns:
        TokenStats in fp32 (fp64 for fp64 logits); only `.logprob` carries a gradient.

    Raises:
        ValueError: on shape/dtype/vocab mismatches or bad support entries (row and slot named).
    """
    rank, world = _group_rank_world(tp_group)
    if vocab_size is None:
        vocab_size = logits.shape[-1] * world if logits.dim() == 2 else 0
    if validate:
        validate_token_inputs(
            logits, sampled_ids, support_ids, support_logprobs, support_valid,
            vocab_size=vocab_size, tp_size=world, temperature=temperature,
        )
    shard = shard_info(rank, world, logits.shape[1], vocab_size)
    logprob_N, max_N2, sums_NP = _VocabParallelTokenStats.apply(
        logits, sampled_ids, support_ids, support_valid, tp_group, shard, float(temperature),
        int(chunk_elems), bool(inplace),
    )
    if validate and logprob_N.numel():
        # NaN or +inf anywhere in a row's (real) logits makes its global max non-finite; the max
        # is replicated after the all-reduce, so every TP rank raises together (no hang).
        bad_N = ~torch.isfinite(max_N2[:, 0])
        if bool(bad_N.any()):
            row = int(bad_N.nonzero()[0, 0])
            raise ValueError(f"logits: row {row} has non-finite values "
                             f"(row max {float(max_N2[row, 0])})")
    s = support_ids.shape[1]
    return assemble_token_stats(
        logprob_N,
        row_max_N=max_N2[:, 0],
        tail_max_N=max_N2[:, 1],
        support_logits_NS=sums_NP[:, :s],
        sum_exp_N=sums_NP[:, s + 1],
        sum_exp2_N=sums_NP[:, s + 2],
        tail_sum_exp_N=sums_NP[:, s + 3],
        tail_sum_exp2_N=sums_NP[:, s + 4],
        sum_exp_not_k_N=sums_NP[:, s + 5],
        support_logprobs_NS=support_logprobs,
        support_valid_NS=support_valid,
        support_ids_NS=support_ids,
        sampled_ids_N=sampled_ids,
        vocab_size=vocab_size,
    )
