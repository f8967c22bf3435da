"""RolloutBatch -> row-aligned `PackedBatch` (padded [b, s] or packed THD with cu_seqlens).

The t-1 -> t shift, done once, here: a sample's tokens are prompt (P) + response (T), length
L = P + T. The logits row at position p predicts token p + 1, so response token t (at position
P + t) is scored by row P + t - 1. Every per-token field of response token t (behavior logprob,
support, loss mask, advantage) is written to row P + t - 1; `labels[p] = tokens[p + 1]`. Rows
0..P-2 (prompt predicting prompt) and the last row L - 1 (which would predict the next sample or
padding) never carry a loss and have an all-invalid support (id 0, logprob -inf). In the THD
layout samples are concatenated, so that last-row rule is what keeps a loss from crossing a
sample boundary.

    tokens:   p0 p1 p2 r0 r1 r2          (P = 3, T = 3)
    row:       0  1  2  3  4  5
    labels:   p1 p2 r0 r1 r2 pad
    loss:      F  F  T  T  T  F          (rows P-1 .. L-2)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from megatron_pdm.intmath import round_up
from rollout_bridge.core.types import PackedBatch, RolloutBatch, RolloutSample

logger = logging.getLogger(__name__)


def _advantages(batch: RolloutBatch, advantages) -> torch.Tensor:
    b = len(batch.samples)
    if advantages is None:
        return torch.zeros(b, dtype=torch.float32)
    adv_b = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
    if adv_b.shape[0] != b:
        raise ValueError(f"got {adv_b.shape[0]} advantages for {b} samples")
    return adv_b


def _check(sample: RolloutSample, i: int) -> tuple[int, int]:
    p, t = int(sample.prompt_ids.shape[0]), sample.num_tokens
    if p < 1:
        raise ValueError(f"sample {i}: empty prompt (the first response token needs a "
                         "predicting row); set prompt_ids")
    s = sample.support_ids.shape
    if s[0] != t or sample.behavior_logprob.shape[0] != t or sample.loss_mask.shape[0] != t:
        raise ValueError(f"sample {i}: per-token fields do not have T={t} rows")
    return p, t


def _empty(rows: int, width: int, s: int, pad_id: int) -> dict[str, torch.Tensor]:
    shape = (rows, width)
    return {
        "tokens": torch.full(shape, pad_id, dtype=torch.int64),
        "position_ids": torch.zeros(shape, dtype=torch.int64),
        "labels": torch.full(shape, pad_id, dtype=torch.int64),
        "loss_mask": torch.zeros(shape, dtype=torch.bool),
        "behavior_logprob": torch.zeros(shape, dtype=torch.float32),
        "support_ids": torch.zeros(shape + (s,), dtype=torch.int32),
        "support_logprobs": torch.full(shape + (s,), -torch.inf, dtype=torch.float32),
        "support_valid": torch.zeros(shape + (s,), dtype=torch.bool),
        "advantages": torch.zeros(shape, dtype=torch.float32),
        "seq_ids": torch.full(shape, -1, dtype=torch.int64),
    }


def _write(f: dict[str, torch.Tensor], row: int, off: int, sample: RolloutSample, seq_id: int,
           adv: float, p: int, t: int) -> None:
    """Writes one sample at [row, off : off + P + T] with the t-1 -> t shift."""
    length = p + t
    seg = slice(off, off + length)
    tokens_l = torch.cat([sample.prompt_ids.to(torch.int64), sample.response_ids.to(torch.int64)])
    f["tokens"][row, seg] = tokens_l
    f["position_ids"][row, seg] = torch.arange(length)
    f["labels"][row, off:off + length - 1] = tokens_l[1:]
    f["seq_ids"][row, seg] = seq_id
    rows = slice(off + p - 1, off + p - 1 + t)  # rows scoring response tokens 0..T-1
    mask_t = sample.loss_mask.to(torch.bool)
    f["loss_mask"][row, rows] = mask_t
    f["behavior_logprob"][row, rows] = torch.where(mask_t, sample.behavior_logprob.float(), 0.0)
    m = mask_t[:, None]
    f["support_ids"][row, rows] = torch.where(m, sample.support_ids.to(torch.int32), 0)
    f["support_logprobs"][row, rows] = torch.where(m, sample.support_logprobs.float(), -torch.inf)
    f["support_valid"][row, rows] = sample.support_valid & m
    f["advantages"][row, rows] = torch.where(mask_t, torch.tensor(adv, dtype=torch.float32), 0.0)


def _facts(batch: RolloutBatch) -> dict:
    """What the rollout fixed and the loss must use: carried on the batch, nowhere else."""
    return {"temperature": batch.temperature, "weight_version": batch.weight_version,
            "vocab_size": batch.vocab_size, "validated": batch.validated}


def _support_width(batch: RolloutBatch) -> int:
    widths = {int(s.support_ids.shape[1]) for s in batch.samples}
    if len(widths) > 1:
        raise ValueError(f"samples have different support widths {sorted(widths)}")
    return widths.pop() if widths else batch.top_logprobs + 1


def pack_padded(batch: RolloutBatch, advantages: Sequence[float] | torch.Tensor | None = None,
                *, pad_id: int = 0, pad_to_multiple_of: int = 1) -> PackedBatch:
    """Packs to the padded [b, s] layout (one sample per row, right padding).

    Args:
        batch: Rollouts; every sample needs prompt_ids (P >= 1).
        advantages: [b] per-sample advantages in `batch.samples` order (None: zeros).
        pad_id: Token id of padding and of the label of each sample's last row.
        pad_to_multiple_of: Round s up (e.g. to the TP size for sequence parallelism).

    Returns:
        `PackedBatch` with [b, s] tensors, cu_seqlens None.
    """
    adv_b = _advantages(batch, advantages)
    lens = [_check(s, i) for i, s in enumerate(batch.samples)]
    width = round_up(max((p + t for p, t in lens), default=1), pad_to_multiple_of)
    f = _empty(len(batch.samples), width, _support_width(batch), pad_id)
    for i, (sample, (p, t)) in enumerate(zip(batch.samples, lens)):
        _write(f, i, 0, sample, i, float(adv_b[i]), p, t)
    return PackedBatch(**f, **_facts(batch))


def pack_thd(batch: RolloutBatch, advantages: Sequence[float] | torch.Tensor | None = None, *,
             pad_id: int = 0, pad_to_multiple_of: int = 1) -> PackedBatch:
    """Packs to the THD layout: samples concatenated into [1, total] with cu_seqlens [b+1].

    Args:
        batch: Rollouts; every sample needs prompt_ids (P >= 1).
        advantages: [b] per-sample advantages (None: zeros).
        pad_id: Padding id.
        pad_to_multiple_of: Pad each sample's segment to a multiple (context parallelism needs
            segments divisible by 2 * CP); padded rows have seq_ids -1 and no loss, and
            cu_seqlens counts the padded lengths.

    Returns:
        `PackedBatch` with [1, total] tensors and cu_seqlens int32.
    """
    adv_b = _advantages(batch, advantages)
    lens = [_check(s, i) for i, s in enumerate(batch.samples)]
    seg_lens = [round_up(p + t, pad_to_multiple_of) for p, t in lens]
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg_lens, dtype=torch.int64), 0).to(torch.int32)
    f = _empty(1, max(int(cu[-1]), 1), _support_width(batch), pad_id)
    for i, (sample, (p, t)) in enumerate(zip(batch.samples, lens)):
        _write(f, 0, int(cu[i]), sample, i, float(adv_b[i]), p, t)
    return PackedBatch(**f, **_facts(batch), cu_seqlens=cu)
