"""Input validation for token_stats: errors a user can cause, reported with the row and slot.

Every check runs on the *replicated* inputs (sampled ids and the support arrays are identical on
all TP ranks), so validation never adds a collective. Each failed check costs one host sync
(`.any()` / `.nonzero()`), which is why token_stats exposes `validate=False` for hot loops whose
data is already trusted (e.g. produced by rollout_bridge.packing, which runs the same checks).

Checks (algorithms.md §3.9, §6): shapes and dtypes; 0 <= id < vocab_size on valid slots;
no duplicate valid ids in a row; finite valid logprobs; sum_S mu <= 1 + 1e-4; the sampled id is
a valid support entry on every row that has any valid slot; 0 <= sampled id < vocab_size.
"""

from __future__ import annotations

import torch

__all__ = ["MU_SUM_TOLERANCE", "validate_token_inputs"]

MU_SUM_TOLERANCE = 1e-4
"""Rows with sum_S mu > 1 + MU_SUM_TOLERANCE are rejected (temperature / top-p mismatch)."""


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


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

    bad = (sampled_ids < 0) | (sampled_ids >= vocab_size)
    if bool(bad.any()):
        (row,) = _first(bad)
        raise ValueError(
            f"sampled_ids: row {row}: id {int(sampled_ids[row])} out of range [0, {vocab_size})"
        )
    ids = support_ids.long()
    valid = support_valid
    bad = valid & ((ids < 0) | (ids >= vocab_size))
    if bool(bad.any()):
        row, slot = _first(bad)
        raise ValueError(
            f"support_ids: row {row}, slot {slot}: id {int(ids[row, slot])} out of range "
            f"[0, {vocab_size})"
        )
    bad = valid & ~torch.isfinite(support_logprobs)
    if bool(bad.any()):
        row, slot = _first(bad)
        raise ValueError(
            f"support_logprobs: row {row}, slot {slot}: non-finite valid logprob "
            f"{float(support_logprobs[row, slot])}"
        )
    if ids.shape[1] > 1:
        # Invalid slots get distinct negative sentinels so they never collide.
        sentinel = -1 - torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        keyed, order = torch.sort(torch.where(valid, ids, sentinel), dim=-1)
        dup = keyed[:, 1:] == keyed[:, :-1]
        if bool(dup.any()):
            row, pos = _first(dup)
            slots = sorted((int(order[row, pos]), int(order[row, pos + 1])))
            raise ValueError(
                f"support_ids: row {row}: duplicate valid id {int(keyed[row, pos])} "
                f"in slots {slots[0]} and {slots[1]}"
            )
    mu_sum = torch.where(valid, support_logprobs.double().exp(), 0.0).sum(-1)
    bad = mu_sum > 1.0 + MU_SUM_TOLERANCE
    if bool(bad.any()):
        (row,) = _first(bad)
        raise ValueError(
            f"support_logprobs: row {row}: sum of behavior probabilities {float(mu_sum[row]):.6f}"
            f" > 1 + {MU_SUM_TOLERANCE}"
        )
    has_k = (valid & (ids == sampled_ids.long()[:, None])).any(-1)
    bad = valid.any(-1) & ~has_k
    if bool(bad.any()):
        (row,) = _first(bad)
        raise ValueError(
            f"support_ids: row {row}: sampled id {int(sampled_ids[row])} is not a valid "
            "support entry (fold the sampled token into the support)"
        )
