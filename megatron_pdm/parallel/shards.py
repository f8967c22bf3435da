"""Vocabulary sharding: which global ids a tensor-parallel rank owns, and which of them are real.

Megatron splits the *padded* vocabulary evenly: rank r holds global ids [r * Vl, (r + 1) * Vl).
Padding ids (>= the engine vocab size) form a suffix of the global range, so on every shard the
real columns are a prefix [0, n_real) of the local columns (n_real may be 0 on the last ranks).
The op simply slices `logits[:, :n_real]`: padding is excluded from every softmax sum without a
masked copy of the shard.

Shape legend: N tokens, S support slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardInfo", "shard_info", "owned_support"]


@dataclass(frozen=True)
class ShardInfo:
    """Ownership of one TP rank.

    Attributes:
        rank: rank in the TP group.
        world: TP group size.
        local_vocab: Vl, columns of the local logits shard (padded).
        vocab_start: first global id owned by this rank.
        n_real: number of local columns that are real (ids < vocab_size), in [0, Vl].
    """

    rank: int
    world: int
    local_vocab: int
    vocab_start: int
    n_real: int


def shard_info(rank: int, world: int, local_vocab: int, vocab_size: int) -> ShardInfo:
    """Ownership of `rank` for an equal split of `local_vocab * world` padded ids."""
    start = rank * local_vocab
    return ShardInfo(rank, world, local_vocab, start, max(0, min(local_vocab, vocab_size - start)))


def owned_support(
    ids_NS: torch.Tensor, valid_NS: torch.Tensor, shard: ShardInfo
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which valid support slots this shard owns, and their local column (0 where not owned).

    Returns:
        (owned_NS bool, local_idx_NS int64)
    """
    local_NS = ids_NS.long() - shard.vocab_start
    owned_NS = valid_NS & (local_NS >= 0) & (local_NS < shard.n_real)
    return owned_NS, torch.where(owned_NS, local_NS, 0)
