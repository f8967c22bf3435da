"""Supervised warm-up before RL: cross-entropy on correct answers (never counted as RL progress).

The toy task starts from a random model, whose reward is ~0, so GRPO would have no signal. A
short supervised phase on the task's reference answers gives a policy that sometimes succeeds;
the RL phase is then measured from there (the report keeps the two apart).

Where the warm-up stops decides what RL can show: the supervised accuracy curve is steep, and a
fixed step count lands at 0.42 greedy accuracy on one CPU and at 0.95 on another (the summation
order of a few reductions differs). `StopRule` makes the starting point a measured quantity:
every `warmup.check_every` steps the engine copy is synced and its greedy accuracy on held-out
probe prompts (disjoint from the evaluation prompts) is measured; the warm-up stops at the first
probe that reaches `warmup.stop_at_accuracy`.

`SftBatch` is a row-aligned micro-batch like the RL `PackedBatch` (row p scores token p+1) and
goes through the same `schedule.optimizer_step`; its loss is megatron's own
`vocab_parallel_cross_entropy` with the padded vocabulary pushed out of the softmax.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_pdm import metrics as M
from megatron_pdm.intmath import round_up

logger = logging.getLogger(__name__)


@dataclass
class SftBatch:
    """tokens, labels, position_ids [b, s] int64; loss_mask [b, s] bool (answer rows)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor

    def select_rows(self, idx: torch.Tensor) -> SftBatch:
        return SftBatch(self.tokens[idx], self.labels[idx], self.loss_mask[idx],
                        self.position_ids[idx])


def drop_optimizer_state(optimizer) -> None:
    """Forget Adam's moments and step count: RL starts from the warm-up's weights with a fresh
    optimizer, so no supervised momentum carries into the RL steps (and a run that loads the
    warm-up's weights, like `compare`, starts RL in exactly the same state)."""
    from megatron_pdm.mcore import optimizer as mopt

    for sub in mopt.sub_optimizers(optimizer):
        sub.optimizer.state.clear()


class StopRule:
    """When to end the warm-up early (see the module docstring); records every probe."""

    def __init__(self, target: float | None, check_every: int):
        self.target = target
        self.check_every = check_every
        self.probes: list[tuple[int, float]] = []  # (supervised steps done, probe accuracy)

    def due(self, steps_done: int) -> bool:
        return self.target is not None and steps_done % self.check_every == 0

    def reached(self, steps_done: int, accuracy: float) -> bool:
        self.probes.append((steps_done, accuracy))
        logger.info("warm-up step %d: probe greedy accuracy %.3f (stop at %.3f)", steps_done,
                    accuracy, self.target)
        return accuracy >= self.target


def sft_batch(task, problems: list, *, pad_id: int, pad_to_multiple_of: int) -> SftBatch:
    """The task's supervised batch, right-padded to a multiple (sequence parallelism)."""
    full = task.sft_batch(problems)
    b, length = full["tokens"].shape
    padded = round_up(length, pad_to_multiple_of)
    extra = padded - length

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, torch.full((b, extra), value, dtype=t.dtype)], dim=1)

    return SftBatch(tokens=pad(full["tokens"], pad_id), labels=pad(full["labels"], pad_id),
                    loss_mask=pad(full["loss_mask"], False),
                    position_ids=torch.arange(padded).expand(b, padded).contiguous())


def sft_loss_func(logits_bsv: torch.Tensor, mb: SftBatch, vocab_size: int, *, head=None):
    """Cross-entropy on answer rows; megatron's padded vocab ids are pushed out of the softmax.
    `head`: a fused-head model's `LMHead` (mcore/lm_head.py): the output is hidden states
    [b, s, H] and the logits are formed here with the output layer's matmul (the warm-up is
    plain cross-entropy; the fused statistics op is the RL loss's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if head is not None:
        logits_bsv = head.logits(logits_bsv)
    vl = logits_bsv.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vl
    pad_cols = torch.arange(start, start + vl, device=logits_bsv.device) >= vocab_size
    logits_bsv = logits_bsv.masked_fill(pad_cols, -1e4)
    # megatron's op takes [s, b, Vl] logits and [s, b] targets.
    ce_sb = vocab_parallel_cross_entropy(logits_bsv.transpose(0, 1).contiguous(),
                                         mb.labels.transpose(0, 1).contiguous())
    mask_sb = mb.loss_mask.transpose(0, 1)
    loss_sum = (ce_sb * mask_sb).sum()
    n = mask_sb.sum()
    metric = torch.stack([loss_sum.detach().double(), n.double()])
    return loss_sum, n.to(torch.int), {M.SFT_LOSS: metric}
