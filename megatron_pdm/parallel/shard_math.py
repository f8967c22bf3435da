"""The per-shard math of the vocab-parallel op: everything one rank does on its [N, Vl] logits
shard between and after the op's collectives. Nothing here communicates (no torch.distributed);
parallel/vocab_parallel.py calls these functions around its two all-reduces, and the unit tests
call them per simulated rank and reduce by hand (tests/ops/test_token_stats.py).

    masked_columns / mask_columns   the support + sampled columns, gathered, then set to -inf
    shard_tail_max                  local max over the rest          -> all-reduce MAX
    shard_tail_sums, pack_sums      local Z_T, S2_T and owned z_S, z_k -> all-reduce SUM
    restore_columns                 bit-exact undo of the masking (default path)
    grad_in_storage / grad_recomputed   the local CE-style backward (two algorithms)

Shape legend: N tokens, Vl local vocab shard (padded), V the shard's real prefix, S support
slots, M = S + 1 masked slots, R rows of one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm.ops.stats import LogSums
from megatron_pdm.parallel.shards import ShardInfo, owned_support

__all__ = [
    "CPU_CHUNK_ELEMS",
    "CPU_THREADS_CHUNK_ELEMS",
    "NUM_SUM_EXTRA",
    "WIDE_CHUNK_ELEMS",
    "GradRows",
    "MaskedColumns",
    "grad_in_storage",
    "grad_recomputed",
    "mask_columns",
    "masked_columns",
    "pack_sums",
    "restore_columns",
    "shard_tail_max",
    "shard_tail_sums",
    "default_chunk_elems",
    "work_dtype",
]

CPU_CHUNK_ELEMS = 1 << 20
"""Row chunks on a CPU running one thread hold at most this many elements (4 MiB fp32): the
passes over one chunk (upcast, shift, exp, sum, sum of squares) then run in the cache, and a
buffer this small is reused by malloc from call to call. With 64 MiB chunks every call paid
fresh pages (a 64 MiB buffer is mmap'ed and faulted in anew each time) and every pass went to
memory: at N 2048 x V_local 16,384 in bf16 that made the op 1.0-1.2x CE's time (docs/op.md)."""

CPU_THREADS_CHUNK_ELEMS = 1 << 22
"""Row chunks on a CPU running several threads (16 MiB fp32), also for the in-place exp pass:
below glibc's 32 MiB mmap threshold, so the buffer is reused rather than faulted in anew, and
few enough chunks that the parallel regions (one per op per chunk, threads meeting at a
barrier) stay few. Paired against CE at 2 threads on a quiet 2-core machine it gave 0.60-0.77x
where 2^24 with an unchunked exp pass gave 0.74-1.15x; on a loaded one it cost what 2^24 did
and 2^20-2^21 cost 2-3x more (docs/op.md, "Where the bf16 time went")."""

WIDE_CHUNK_ELEMS = 1 << 24
"""Row chunks on an accelerator hold at most this many elements (64 MiB fp32): few, large
kernels; the in-place exp pass is then not chunked at all (one kernel per pass)."""


def default_chunk_elems(device: torch.device, *, in_storage: bool = False) -> int:
    """The row-chunk bound used when the caller gives none: on a CPU `CPU_CHUNK_ELEMS` with one
    thread and `CPU_THREADS_CHUNK_ELEMS` with more, on an accelerator `WIDE_CHUNK_ELEMS`
    (unbounded for the in-place exp pass, `in_storage`). Only the chunk size differs; the code
    path is the same, and every row's reductions stay inside one chunk, so no bit changes."""
    if torch.device(device).type == "cpu":
        return CPU_CHUNK_ELEMS if torch.get_num_threads() == 1 else CPU_THREADS_CHUNK_ELEMS
    return 1 << 62 if in_storage else WIDE_CHUNK_ELEMS


NUM_SUM_EXTRA = 3
"""Columns after z_S in the packed SUM: z_k, Z_T, S2_T."""


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The op's working dtype for logits of `dtype`: fp64 for fp64, fp32 otherwise."""
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
    chunk_elems: int | None = None,
    in_storage: bool = False,
) -> torch.Tensor:
    """Local exact tail sums relative to the global shift: [N, 2] = (Z_T, S2_T).

    `real_NV` has its masked columns at -inf (they contribute e^-inf = 0). With `in_storage`
    (the logits already in the working dtype, in-place mode) e = exp(z/T - shift) is computed in
    the logits' own storage and left there for backward; otherwise a reusable fp32 row-chunk
    buffer holds it. Either way the rows go in chunks of at most `chunk_elems` elements
    (None: `default_chunk_elems` of the device), every pass of a chunk done before the next.
    """
    work = shift_N.dtype
    n, v = real_NV.shape
    out_N2 = torch.zeros((n, 2), dtype=work, device=real_NV.device)
    if v == 0 or n == 0:
        return out_N2
    if chunk_elems is None:
        chunk_elems = default_chunk_elems(real_NV.device, in_storage=in_storage)
    buf = None
    for r0, r1 in _chunks(n, v, chunk_elems):
        if in_storage:
            dst_RV = real_NV[r0:r1]
        else:
            if buf is None:  # the only [rows, Vl] temporary, reused by every chunk
                buf = torch.empty((r1 - r0, v), dtype=work, device=real_NV.device)
            dst_RV = buf[: r1 - r0]
        e_RV = _exp_shifted_(dst_RV, real_NV[r0:r1], shift_N[r0:r1], temperature)
        out_N2[r0:r1, 0] = e_RV.sum(-1)
        # sum of squares in one read pass (no squared temporary)
        out_N2[r0:r1, 1] = torch.linalg.vector_norm(e_RV, 2, -1).square_()
    return out_N2


def pack_sums(cols: MaskedColumns, tail_sums_N2: torch.Tensor, temperature: float
              ) -> torch.Tensor:
    """The SUM all-reduce payload [N, S + 3]: z_S | z_k (tempered, owner's value, else 0) |
    Z_T | S2_T (this shard's partial sums)."""
    z_NM = torch.where(cols.owned_NM, cols.z_NM.to(tail_sums_N2.dtype) / temperature, 0.0)
    return torch.cat([z_NM, tail_sums_N2], 1)


# -- backward --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradRows:
    """What the local backward needs of each row, saved by forward ([N] unless noted).

    Attributes:
        idx_NM, owned_NM: `MaskedColumns.idx_NM` / `.owned_NM` ([N, M]).
        is_sampled_NS: [N, S] the slot of the sampled token.
        ref_N, tail_rel_N, log_z_N, log_z_not_k_N, support_rel_NS: the `LogSums` fields of the
            same names (relative to the row max `ref`, so every factor formed from them is <= 1:
            nothing overflows).
    """

    idx_NM: torch.Tensor
    owned_NM: torch.Tensor
    is_sampled_NS: torch.Tensor
    ref_N: torch.Tensor
    tail_rel_N: torch.Tensor
    log_z_N: torch.Tensor
    log_z_not_k_N: torch.Tensor
    support_rel_NS: torch.Tensor

    @classmethod
    def of(cls, cols: MaskedColumns, is_sampled_NS: torch.Tensor, ls: LogSums) -> GradRows:
        return cls(cols.idx_NM, cols.owned_NM, is_sampled_NS, ls.ref, ls.tail_rel, ls.log_z,
                   ls.log_z_not_k, ls.support_rel)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in order (for `ctx.save_for_backward`; `GradRows(*saved)` rebuilds)."""
        return (self.idx_NM, self.owned_NM, self.is_sampled_NS, self.ref_N, self.tail_rel_N,
                self.log_z_N, self.log_z_not_k_N, self.support_rel_NS)


def _grad_scale(rows: GradRows, grad_N: torch.Tensor, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g/T [N], the sampled column's exact value g/T (1 - pi_k) [N], 0 where not owned).

    1 - pi_k = e^{log Z_-k - log Z} from the complement: no cancellation."""
    s = rows.is_sampled_NS.shape[1]
    scale_N = grad_N.to(rows.ref_N.dtype) / temperature
    one_m_pi_k_N = torch.exp(rows.log_z_not_k_N - rows.log_z_N)
    val_k_N = torch.where(rows.owned_NM[:, s], scale_N * one_m_pi_k_N, 0.0)
    return scale_N, val_k_N


def grad_in_storage(e_NVl: torch.Tensor, rows: GradRows, grad_N: torch.Tensor, *,
                    shard: ShardInfo, temperature: float) -> torch.Tensor:
    """Local gradient of sum_t grad_t * log pi_k(t), written into the forward's exp storage.

    Args:
        e_NVl: the logits' storage as the in-place forward left it: real columns hold
            e = exp(z/T - t) (t the tail max), 0 on the masked columns. Overwritten.
        rows: saved by forward. grad_N: upstream gradient of log pi_k.
        shard, temperature: as forward.

    One scaling pass plus a scatter of the masked columns' exact values.

    Returns:
        `e_NVl`, now grad/T * (onehot_k - softmax), 0 on padding.
    """
    out_NVl = e_NVl
    out_NVl[:, shard.n_real:].zero_()
    if shard.n_real == 0 or e_NVl.shape[0] == 0:
        return out_NVl
    s = rows.is_sampled_NS.shape[1]
    scale_N, val_k_N = _grad_scale(rows, grad_N, temperature)
    real_NV = out_NVl[:, : shard.n_real]
    # pi_j = e_j * exp(t - ref - log Z_rel): one factor per row, -g/T folded in (0 when the
    # tail is empty: e is 0 everywhere then)
    factor_N = -scale_N * torch.exp(rows.tail_rel_N - rows.log_z_N)
    # masked columns hold 0: add -g/T pi_i on owned support columns (i != k) and the exact
    # k value; the non-owned slots add 0 to column 0 (exact, order-independent).
    other_NS = rows.owned_NM[:, :s] & ~rows.is_sampled_NS
    val_NS = torch.where(other_NS, -scale_N[:, None] * torch.exp(
        rows.support_rel_NS - rows.log_z_N[:, None]), 0.0)
    real_NV.mul_(factor_N[:, None])
    real_NV.scatter_add_(1, rows.idx_NM, torch.cat([val_NS, val_k_N[:, None]], 1)
                         .to(real_NV.dtype))
    return out_NVl


def grad_recomputed(logits_NVl: torch.Tensor, rows: GradRows, grad_N: torch.Tensor, *,
                    shard: ShardInfo, temperature: float,
                    chunk_elems: int | None = None) -> torch.Tensor:
    """Local gradient of sum_t grad_t * log pi_k(t) from the intact logits, softmax recomputed.

    Args:
        logits_NVl: the saved logits (unchanged by the default forward).
        rows: saved by forward. grad_N: upstream gradient of log pi_k.
        shard, temperature, chunk_elems: as forward (None: `default_chunk_elems`).

    The softmax is recomputed chunk by chunk into the gradient (fp32/fp64 logits) or through a
    reused fp32 buffer (bf16/fp16), and the sampled column is overwritten with its exact value.

    Returns:
        [N, Vl] grad/T * (onehot_k - softmax) in the logits' dtype, 0 on padding.
    """
    n = logits_NVl.shape[0]
    out_NVl = torch.empty_like(logits_NVl, memory_format=torch.contiguous_format)
    out_NVl[:, shard.n_real:].zero_()
    if shard.n_real == 0 or n == 0:
        return out_NVl
    s = rows.is_sampled_NS.shape[1]
    work = rows.ref_N.dtype
    scale_N, val_k_N = _grad_scale(rows, grad_N, temperature)
    real_NV = out_NVl[:, : shard.n_real]
    # softmax = exp(z/T - ref) * exp(-log Z_rel), ref the row max: recomputed, -g/T folded in
    factor_N = -scale_N * torch.exp(-rows.log_z_N)
    direct = logits_NVl.dtype == work
    src_NV = logits_NVl[:, : shard.n_real]
    k_idx_N1 = rows.idx_NM[:, s:]
    if chunk_elems is None:
        chunk_elems = default_chunk_elems(logits_NVl.device)
    buf = None
    for r0, r1 in _chunks(n, shard.n_real, chunk_elems):
        dst_RV = real_NV[r0:r1]
        if direct:
            p_RV = dst_RV
        else:
            if buf is None:
                buf = torch.empty((r1 - r0, shard.n_real), dtype=work, device=logits_NVl.device)
            p_RV = buf[: r1 - r0]
        _exp_shifted_(p_RV, src_NV[r0:r1], rows.ref_N[r0:r1], temperature)
        p_RV.mul_(factor_N[r0:r1, None])
        # one write per row: the exact k value where owned, the value already there elsewhere
        kk_R1 = k_idx_N1[r0:r1]
        keep_R1 = p_RV.gather(1, kk_R1)
        p_RV.scatter_(1, kk_R1, torch.where(rows.owned_NM[r0:r1, s:], val_k_N[r0:r1, None],
                                            keep_R1))
        if not direct:
            dst_RV.copy_(p_RV)
    return out_NVl
