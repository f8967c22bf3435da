"""What the two vocab-parallel ops (vocab_parallel.py, fused_head.py) share around their collectives.

- `all_reduce(t, op, group)`: the single door of the ops' collectives (in place; a no-op on one
  device). The call sites stay in the op modules, each under a comment naming the collective and
  its payload: this module only decides whether there is anyone to talk to.
- `group_rank_world(group)`: (rank, world size) of a TP group, (0, 1) for None.
- `check_reduced_rows(stats, tail_max_N, packed_NP)`: the ops' validate=True check of the rows
  after both collectives (their payloads are replicated, so every TP rank raises together).

Shape legend: N tokens, S support slots, P = S + 3 packed columns (z_S | z_k | Z_T | S2_T).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pdm.ops.stats import TokenStats

__all__ = ["all_reduce", "check_reduced_rows", "group_rank_world"]


def all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    """All-reduces `t` in place over `group` and returns it; no-op for None or world size 1.
    (Tests patch `torch.distributed.all_reduce` to count the calls.)"""
    if group is None or dist.get_world_size(group) == 1:
        return t
    dist.all_reduce(t, op=op, group=group)
    return t


def group_rank_world(group) -> tuple[int, int]:
    """(rank in `group`, size of `group`); (0, 1) for None (a single device)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_reduced_rows(stats: TokenStats, tail_max_N: torch.Tensor,
                       packed_NP: torch.Tensor) -> None:
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
