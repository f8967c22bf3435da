"""PDM in your own forward_step: rows, the one loss call, normalisation and alignment checks.

For a training loop that is not this project's driver (docs/own-loop.md). Torch only; works with
or without megatron-core. The pieces, in the order a loop uses them:

    rows   = response_rows(prompt_lens, response_lens, seq_len=T)     # row p scores token p+1
    placed = place_on_rows(logits_btv, rows, sampled_ids=..., support_ids=..., ...)
    out    = loss_on_rows(placed, cfg, tp_group=..., vocab_size=..., temperature=...)
    loss   = normalize_loss(out.loss_sum, placed.loss_mask, "token-mean", seq_ids=placed.seq_ids)

The shift. Logits row p is the model's distribution of token p+1. A response token at sequence
position q (prompt length P: q = P + j for its j-th response token) is therefore scored by row
q - 1. `response_rows` computes these rows once; every response-aligned field (engine top-K,
sampled ids, behaviour logprobs, advantages) is placed on them by `place_on_rows`.

No copy of the vocab shard. Slicing the response rows out of `[B, T, V_local]` logits, or
concatenating per-sample slices, copies the shard. Instead the op runs on one contiguous row
range of the flattened logits (a view: same storage, `.data_ptr()` offset only), from the first
response row to the last, and the small per-token fields are scattered onto that range (rows
in between carry no loss and an all-invalid support, so they add no gradient).

The fast path. `loss_on_rows(inplace=None)` works in the logits' storage (token_stats'
`inplace=True`: one exp pass, no [N, V_local] allocation) exactly when that is safe to decide
here: fp32 / fp64 logits that require a gradient and are not a leaf, i.e. the model's output
handed to its loss, as megatron's own cross-entropy consumes it. Not a leaf: autograd forbids
in-place changes of a leaf that requires grad. No gradient: an evaluation pass, whose caller
usually reads the logits again. What this function cannot see is whether your code reads the
logits after the call (an entropy bonus, a KL to a reference model, logging): then pass
`inplace=False`. Autograd raises (never silently wrong) when another node saved the logits.

Shape legend: B samples, T sequence length, V vocabulary shard, R response tokens (all samples),
N rows of the placed range, S support slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.distributed as dist

from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.loss.policy_loss import PolicyLossOutput, policy_loss
from megatron_pdm.ops import offpolicy as _offpolicy
from megatron_pdm.parallel.vocab_parallel import token_stats

__all__ = ["PlacedRows", "Rows", "auto_inplace", "check_logprob_alignment", "loss_on_rows",
           "normalize_loss", "place_on_rows", "response_rows"]

Normalization = Literal["sum", "token-mean", "sequence-mean"]


@dataclass(frozen=True)
class Rows:
    """Flattened logits rows of the response tokens, in response order.

    Attributes:
        index: [R] int64 row of each response token in the flattened `[B * T]` (or packed
            `[total]`) logits: the row that scores it.
        sample: [R] int64 sample of each response token; position: [R] its position in the
            sequence (the token's own, q; its row is q - 1 inside the sample).
        lo, hi: the contiguous row range [lo, hi) holding every response row (host ints).
    """

    index: torch.Tensor
    sample: torch.Tensor
    position: torch.Tensor
    lo: int
    hi: int


def response_rows(prompt_lens: Sequence[int], response_lens: Sequence[int], *,
                  seq_len: int | None = None, packed: bool = False) -> Rows:
    """The logits rows that score each sample's response tokens (row p scores token p+1).

    Args:
        prompt_lens, response_lens: per sample (host ints); every prompt has >= 1 token.
        seq_len: T of a padded `[B, T]` batch (sample b starts at row b * T); with `packed`,
            samples follow each other (THD, `[1, total]`: sample b starts at the sum of the
            previous prompt + response lengths) and seq_len is the total, checked when given.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response "
                         "lengths")
    index, sample, position, start = [], [], [], 0
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        p, r = int(p), int(r)
        if p < 1 or r < 0:
            raise ValueError(f"sample {b}: prompt length {p} (needs >= 1: the first response "
                             f"token is scored by the prompt's last row), response length {r}")
        length = p + r
        if not packed:
            if seq_len is None:
                raise ValueError("seq_len is required for a padded [B, T] batch")
            if length > seq_len:
                raise ValueError(f"sample {b}: prompt {p} + response {r} > seq_len {seq_len}")
            start = b * seq_len
        index += range(start + p - 1, start + p - 1 + r)
        sample += [b] * r
        position += range(p, p + r)
        if packed:
            start += length
    if packed and seq_len is not None and start != seq_len:
        raise ValueError(f"packed lengths sum to {start}, not seq_len {seq_len}")
    if not index:
        raise ValueError("no response tokens")
    return Rows(torch.tensor(index), torch.tensor(sample), torch.tensor(position),
                min(index), max(index) + 1)


@dataclass(frozen=True)
class PlacedRows:
    """The op's inputs on the row range [lo, hi) of the flattened logits (N = hi - lo rows).

    `logits` is a view of the caller's logits (no copy); the other fields are [N] / [N, S]
    tensors with the response values on their rows and neutral values elsewhere (loss_mask
    False, support all invalid, sampled id 0, behaviour logprob 0, advantage 0, seq id -1).
    """

    logits: torch.Tensor
    sampled_ids: torch.Tensor
    support_ids: torch.Tensor
    support_logprobs: torch.Tensor
    support_valid: torch.Tensor
    behavior_logprob: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor
    positions: torch.Tensor
    rows: Rows


def _flat_view(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V_local], got {tuple(logits.shape)}")
    try:
        return logits.view(-1, logits.shape[-1])
    except RuntimeError as err:
        raise ValueError(f"logits {tuple(logits.shape)} with strides {logits.stride()} cannot be "
                         "flattened to rows without a copy (pass a [B, T, V] or [T, V] tensor "
                         "contiguous over its row dimensions)") from err


def place_on_rows(logits: torch.Tensor, rows: Rows, *, sampled_ids: torch.Tensor,
                  support_ids: torch.Tensor, support_logprobs: torch.Tensor,
                  support_valid: torch.Tensor, behavior_logprob: torch.Tensor,
                  advantages: torch.Tensor) -> PlacedRows:
    """Places response-aligned fields ([R], [R, S], in `rows` order) on the logits rows.

    Args:
        logits: `[B, T, V_local]`, `[1, total, V_local]` or `[T, V_local]`, rows flattenable
            without a copy. Only the range [rows.lo, rows.hi) is used (a view).
        rows: from `response_rows`.
        sampled_ids [R], support_* [R, S] (folded: `fold_support` / `fold_support_torch`),
        behavior_logprob [R], advantages [R]: one entry per response token.
    """
    flat_NV = _flat_view(logits)
    if rows.hi > flat_NV.shape[0]:
        raise ValueError(f"rows reach row {rows.hi - 1} but the logits have {flat_NV.shape[0]}")
    r = rows.index.shape[0]
    for name, t, dims in (("sampled_ids", sampled_ids, 1), ("support_ids", support_ids, 2),
                          ("support_logprobs", support_logprobs, 2),
                          ("support_valid", support_valid, 2),
                          ("behavior_logprob", behavior_logprob, 1), ("advantages", advantages, 1)):
        if t.dim() != dims or t.shape[0] != r or (dims == 2 and t.shape[1] != support_ids.shape[1]):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected "
                             f"{'[R]' if dims == 1 else '[R, S]'} with R = {r} response tokens")
    n, s, dev = rows.hi - rows.lo, support_ids.shape[1], flat_NV.device
    at_R = (rows.index - rows.lo).to(dev)

    def scatter(values, fill, shape, dtype):
        out = torch.full(shape, fill, dtype=dtype, device=dev)
        out[at_R] = values.to(device=dev, dtype=dtype)
        return out

    return PlacedRows(
        logits=flat_NV[rows.lo:rows.hi],  # a view: no copy of the vocab shard
        sampled_ids=scatter(sampled_ids, 0, (n,), torch.int64),
        support_ids=scatter(support_ids, 0, (n, s), support_ids.dtype),
        support_logprobs=scatter(support_logprobs, -torch.inf, (n, s), support_logprobs.dtype),
        support_valid=scatter(support_valid, False, (n, s), torch.bool),
        behavior_logprob=scatter(behavior_logprob, 0.0, (n,), torch.float32),
        advantages=scatter(advantages, 0.0, (n,), torch.float32),
        loss_mask=scatter(torch.ones(r, dtype=torch.bool), False, (n,), torch.bool),
        seq_ids=scatter(rows.sample, -1, (n,), torch.int64),
        positions=scatter(rows.position, -1, (n,), torch.int64),
        rows=rows,
    )


def auto_inplace(logits: torch.Tensor) -> bool:
    """The fast path's safety rule of the module docstring: fp32/fp64, requires grad, no leaf."""
    return (logits.dtype in (torch.float32, torch.float64) and logits.requires_grad
            and not logits.is_leaf)


def _sampled_logprob(logits_NV, ids_N, *, tp_group, vocab_size, temperature) -> torch.Tensor:
    """log pi of `ids_N` per row (the op with an empty support; no grad, logits untouched)."""
    with torch.no_grad():
        n = ids_N.shape[0]
        empty = (torch.zeros(n, 1, dtype=torch.int32, device=ids_N.device),
                 torch.full((n, 1), -torch.inf, device=ids_N.device),
                 torch.zeros(n, 1, dtype=torch.bool, device=ids_N.device))
        return token_stats(logits_NV.detach(), ids_N, *empty, tp_group=tp_group,
                           vocab_size=vocab_size, temperature=temperature,
                           validate=False).logprob


def check_logprob_alignment(placed: PlacedRows, *, tp_group, vocab_size: int | None,
                            temperature: float, tol: float = 0.05) -> float:
    """Behaviour logprob vs the policy's at the sampled token; raises naming sample and position.

    Meant for a step where the policy should equal the engine's (the first step after a weight
    sync, dropout off: megatron's default attention / hidden dropout of 0.1 alone moves log pi
    by more than `tol`). Passes when every loss row agrees within `tol` (returns the max abs
    difference). Otherwise it tries the two usual causes, each over all loss rows: the logits at
    temperature 1 (the engine sampled at `temperature`, or the loop passes the wrong one), and
    the same sequence one row earlier / later (the t-1 -> t shift done twice or not at all).
    Costs up to four op forwards (no gradient); reads the logits, so call it before the loss.
    """
    p = placed
    kw = dict(tp_group=tp_group, vocab_size=vocab_size)
    lm_N, blp_N = p.loss_mask, p.behavior_logprob.to(torch.float64)
    lp_N = _sampled_logprob(p.logits, p.sampled_ids, temperature=temperature, **kw).double()
    diff_N = torch.where(lm_N, (lp_N - blp_N).abs(), 0.0)
    worst = float(diff_N.max())
    if worst <= tol:
        return worst
    mean = float(diff_N.sum() / lm_N.sum())
    row = int(diff_N.argmax())
    where = f"sample {int(p.seq_ids[row])}, position {int(p.positions[row])}"
    found = []
    if float(temperature) != 1.0:
        lp1_N = _sampled_logprob(p.logits, p.sampled_ids, temperature=1.0, **kw).double()
        found.append((float(torch.where(lm_N, (lp1_N - blp_N).abs(), 0.0).sum() / lm_N.sum()),
                      f"they match the logits at temperature 1.0, not {temperature}: a "
                      "temperature mismatch between the engine and the loss"))
    for shift, how in ((1, "one row later (row p + 1 scoring token p + 1: the shift is "
                           "missing)"), (-1, "one row earlier (the shift was applied twice)")):
        same_N = torch.zeros_like(lm_N)
        lp_s_N = torch.zeros_like(lp_N)
        if shift == 1:   # logits row p + 1 scoring the token placed on row p
            lp_s_N[:-1] = _sampled_logprob(p.logits[1:], p.sampled_ids[:-1],
                                           temperature=temperature, **kw).double()
            same_N[:-1] = lm_N[:-1] & (p.seq_ids[1:] == p.seq_ids[:-1])
        else:
            lp_s_N[1:] = _sampled_logprob(p.logits[:-1], p.sampled_ids[1:],
                                          temperature=temperature, **kw).double()
            same_N[1:] = lm_N[1:] & (p.seq_ids[:-1] == p.seq_ids[1:])
        if bool(same_N.any()):
            m = float(torch.where(same_N, (lp_s_N - blp_N).abs(), 0.0).sum() / same_N.sum())
            found.append((m, f"they match the policy {how}"))
    best = min(found, default=None)
    hint = (f"; {best[1]} (mean abs difference {best[0]:.3g})"
            if best is not None and best[0] < 0.5 * mean else "")
    raise ValueError(f"behaviour logprobs disagree with the policy's: {where}: |log pi - log mu| "
                     f"= {worst:.4g} > tol {tol} (mean {mean:.3g} over loss rows){hint}")


def loss_on_rows(placed: PlacedRows, cfg: PolicyLossConfig, *, tp_group,
                 vocab_size: int | None, temperature: float, inplace: bool | None = None,
                 check_alignment: bool = False, alignment_tol: float = 0.05,
                 validate: bool = True) -> PolicyLossOutput:
    """`token_stats` + `policy_loss` on placed rows (megatron-core's (sum, count, metrics)).

    Args:
        placed: from `place_on_rows`.
        cfg: the method (`PolicyLossConfig.preset(...)`).
        tp_group, vocab_size, temperature: as `token_stats` (no defaults for the first two).
        inplace: None = `auto_inplace(logits)` (module docstring); True / False to force.
        check_alignment: run `check_logprob_alignment` first (raises naming sample, position).
        validate: the op's and the loss's input checks (host syncs; off for checked batches).
    """
    if check_alignment:
        check_logprob_alignment(placed, tp_group=tp_group, vocab_size=vocab_size,
                                temperature=temperature, tol=alignment_tol)
    fast = auto_inplace(placed.logits) if inplace is None else bool(inplace)
    stats = token_stats(placed.logits, placed.sampled_ids, placed.support_ids,
                        placed.support_logprobs, placed.support_valid, tp_group=tp_group,
                        vocab_size=vocab_size, temperature=temperature, validate=validate,
                        inplace=fast)
    return policy_loss(stats, placed.advantages, placed.behavior_logprob, placed.loss_mask, cfg,
                       seq_ids=placed.seq_ids, check_inputs=validate)


def normalize_loss(loss_sum: torch.Tensor, loss_mask: torch.Tensor, how: Normalization, *,
                   seq_ids: torch.Tensor | None = None, group=None,
                   grads_averaged: bool = True) -> torch.Tensor:
    """The scalar to back-propagate for a loop outside megatron's DDP (the contract).

    `policy_loss` returns megatron-core's per-token contract: loss_sum is a SUM over loss rows
    (divided by loss_horizon for "seq-mean-token-sum-norm") and megatron divides the gradients
    by the global num_tokens itself. Outside it, `loss_sum.backward()` gives a summed gradient.
    This returns L with
        "sum":           L = loss_sum                                  (gradient of the sum)
        "token-mean":    L = loss_sum / (global count of loss rows)
        "sequence-mean": L = loss_sum / (global count of sequences with a loss row; seq_ids)
    so that after your data-parallel gradient reduction the gradient is exactly that mean over
    the whole global batch. `group`: the data-parallel group (the count is all-reduced over it:
    one all_reduce SUM of one element); `grads_averaged`: your wrapper averages gradients over
    `group` (PyTorch DDP, FSDP do), so L is multiplied by its size; False for a summing wrapper.
    A count of 0 gives L = loss_sum * 0 (no NaN).
    """
    lm_N = loss_mask.to(torch.bool)
    if how == "sum":
        return loss_sum
    if how == "token-mean":
        count = lm_N.sum().to(torch.float64)
    elif how == "sequence-mean":
        if seq_ids is None:
            raise ValueError("normalize_loss('sequence-mean') needs seq_ids")
        count = _offpolicy.num_sequences(seq_ids, lm_N & (seq_ids >= 0)).to(torch.float64)
    else:
        raise ValueError(f"normalization must be 'sum', 'token-mean' or 'sequence-mean', got "
                         f"{how!r}")
    scale = 1.0
    if group is not None:
        count = count.reshape(1).clone()
        dist.all_reduce(count, group=group)  # SUM of the loss-row / sequence count over DP ranks
        count = count[0]
        if grads_averaged:
            scale = float(dist.get_world_size(group))
    factor = torch.where(count > 0, scale / count.clamp_min(1.0), 0.0)
    return loss_sum * factor.to(loss_sum.dtype)
