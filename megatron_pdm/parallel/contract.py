"""The call contract both vocab-parallel ops share, stated and checked once.

`token_stats` (logits shard) and `fused_token_stats` (hidden states and the LM-head weight
shard) take the same behaviour support, the same `tp_group` / `vocab_size` keywords and the same
`validate` switch. What a call must satisfy, and what is checked after the op's two all-reduces,
lives here so the two entry points cannot drift apart:

- `tp_group` is the group the vocabulary is sharded over, or None for one device (no default).
- `vocab_size` is the engine's vocabulary (ids >= it are padding), or None for "no padding at
  all", which only a single device can vouch for: refused on a shard of more than one rank.
- the support arrays follow ops/support.py; `validate=True` checks their values on the host (a
  sync) and, after the forward, that no row holds NaN / +inf or only -inf; `validate=False`
  checks shapes, dtypes, vocab_size and temperature only (no tensor data read).

Shape legend: N tokens, S support slots, Vl local (padded) vocabulary columns.
"""

from __future__ import annotations

import torch

from megatron_pdm.ops.stats import LogSums, TokenStats, assemble_token_stats
from megatron_pdm.ops.validation import check_token_args, check_vocab_size, validate_token_inputs
from megatron_pdm.parallel.collectives import check_reduced_rows, group_rank_world
from megatron_pdm.parallel.shards import ShardInfo, shard_info

__all__ = ["open_call", "close_call"]


def open_call(logits_NV: torch.Tensor, sampled_ids_N, support_ids_NS, support_logprobs_NS,
              support_valid_NS, *, tp_group, vocab_size, temperature: float,
              validate: bool) -> tuple[int, ShardInfo]:
    """Checks a call (raising TypeError / ValueError naming the argument, row or slot) and
    returns (the engine vocabulary size, this rank's shard). `logits_NV` may be a meta tensor of
    the logits' shape and dtype (the fused head has no logits)."""
    rank, world = group_rank_world(tp_group)
    check_vocab_size(vocab_size)
    v_local = logits_NV.shape[-1] if logits_NV.dim() == 2 else 0
    if vocab_size is None:
        if world > 1:
            raise ValueError(f"vocab_size=None on a vocab shard (tp_group of {world} ranks): "
                             "pass the engine's vocabulary size (the sharded vocabulary is "
                             "padded; None says 'no padding' and is for a single device)")
        vocab_size = v_local
    vocab_size = int(vocab_size)
    args = (logits_NV, sampled_ids_N, support_ids_NS, support_logprobs_NS, support_valid_NS)
    if validate:
        validate_token_inputs(*args, vocab_size=vocab_size, tp_size=world,
                              temperature=temperature)
    else:
        check_token_args(*args, vocab_size=vocab_size, tp_size=world, temperature=temperature)
    return vocab_size, shard_info(rank, world, v_local, vocab_size)


def close_call(logprob_N: torch.Tensor, sums: list, tail_max_N: torch.Tensor,
               packed_NP: torch.Tensor, is_sampled_NS: torch.Tensor, *, support_ids_NS,
               support_logprobs_NS, support_valid_NS, vocab_size: int,
               validate: bool) -> TokenStats:
    """The op's reduced outputs as TokenStats; with `validate`, the row check on them (one
    host sync: a row with NaN / +inf logits or no finite logit is named)."""
    stats = assemble_token_stats(
        logprob_N,
        LogSums(*sums),
        support_logprobs_NS=support_logprobs_NS,
        support_valid_NS=support_valid_NS,
        support_ids_NS=support_ids_NS,
        is_sampled_NS=is_sampled_NS,
        vocab_size=vocab_size,
    )
    if validate and logprob_N.numel():
        check_reduced_rows(stats, tail_max_N, packed_NP)
    return stats
