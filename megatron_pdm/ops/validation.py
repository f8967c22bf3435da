"""Input validation for token_stats: errors a user can cause, reported with the row and slot.

Every check runs on the *replicated* inputs (sampled ids and the support arrays are identical on
all TP ranks), so validation never adds a collective. It copies those small arrays to the host
once, which is why token_stats exposes `validate=False` for hot loops whose data was already
checked where it entered the system (rollout_bridge: every engine runs the same
`ops/support.py:check_support` on each sample it produces).

Checks: shapes, dtypes, vocabulary and temperature here; the support rules (docs/math.md §3.9,
§6: id ranges, duplicates, finite logprobs, sum of mu, sampled token folded in) in
`ops/support.py`, shared with the rollout engines.
"""

from __future__ import annotations

import torch

from megatron_pdm.ops.support import check_support

__all__ = ["validate_token_inputs"]


def validate_token_inputs(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    support_ids: torch.Tensor,
    support_logprobs: torch.Tensor,
    support_valid: torch.Tensor,
    *,
    vocab_size: int,
    tp_size: int,
    temperature: float,
) -> None:
    """Raises ValueError naming the argument, row and slot of the first bad entry.

    Args:
        logits: [N, Vl] local shard.
        sampled_ids: [N] global ids.
        support_ids, support_logprobs, support_valid: [N, S].
        vocab_size: engine vocabulary size.
        tp_size: tensor-parallel world size.
        temperature: sampling temperature (> 0).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [N, V_local], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"logits: unsupported dtype {logits.dtype}")
    n, v_local = logits.shape
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if vocab_size <= 0 or v_local * tp_size < vocab_size:
        raise ValueError(
            f"vocab mismatch: V_local={v_local} x tp_size={tp_size} = {v_local * tp_size} "
            f"< vocab_size={vocab_size}"
        )
    if sampled_ids.shape != (n,):
        raise ValueError(f"sampled_ids: expected shape ({n},), got {tuple(sampled_ids.shape)}")
    if support_ids.dim() != 2 or support_ids.shape[0] != n:
        raise ValueError(f"support_ids: expected [{n}, S], got {tuple(support_ids.shape)}")
    for name, t in (("support_logprobs", support_logprobs), ("support_valid", support_valid)):
        if t.shape != support_ids.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(support_ids.shape)}, got {tuple(t.shape)}"
            )
    if support_ids.dtype not in (torch.int32, torch.int64) or sampled_ids.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError("sampled_ids and support_ids must be int32 or int64")
    if support_valid.dtype != torch.bool:
        raise ValueError(f"support_valid: expected bool, got {support_valid.dtype}")
    if not support_logprobs.is_floating_point():
        raise ValueError(f"support_logprobs: expected a float dtype, got {support_logprobs.dtype}")
    if n == 0:
        return
    # One host copy of the small replicated arrays; the rules live in ops/support.py.
    check_support(
        support_ids.detach().cpu().numpy(), support_logprobs.detach().float().cpu().numpy(),
        support_valid.detach().cpu().numpy(), sampled_ids.detach().cpu().numpy(), vocab_size)
