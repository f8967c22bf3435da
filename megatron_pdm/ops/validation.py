"""Input validation for token_stats: errors a user can cause, reported with the row and slot.

Two levels:

* `check_token_args` reads only shapes, dtypes and Python numbers (vocabulary size, temperature):
  no tensor data, so no device -> host synchronisation. token_stats runs it on every call.
* `validate_token_inputs` adds the value checks of the support (docs/math.md §3.9, §6: id
  ranges, duplicates, finite logprobs, sum of mu, sampled token folded in; the rules live in
  `ops/support.py`, shared with the rollout engines). It copies the small *replicated* arrays
  (sampled ids and the support, identical on all TP ranks) to the host once, so it never adds a
  collective but does synchronise: token_stats runs it only with `validate=True`. Hot loops whose
  data was checked where it entered the system (rollout_bridge: every engine runs the same
  `check_support` on each sample it produces) pass `validate=False`.
"""

from __future__ import annotations

import math
import numbers

import torch

from megatron_pdm.ops.support import check_support

__all__ = ["check_token_args", "check_vocab_size", "validate_token_inputs"]


def check_vocab_size(vocab_size) -> None:
    """vocab_size must be a Python/numpy integer (not a float, not a bool), or None."""
    if vocab_size is None:
        return
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size must be an int (the engine's vocabulary size), got "
                        f"{vocab_size!r} of type {type(vocab_size).__name__}")


def check_token_args(
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
    """Shapes, dtypes, vocabulary and temperature; reads no tensor data (no host sync).

    Raises:
        TypeError: vocab_size is not an integer.
        ValueError: naming the argument and what is wrong.
    """
    check_vocab_size(vocab_size)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [N, V_local], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"logits: unsupported dtype {logits.dtype}")
    n, v_local = logits.shape
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
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
    """`check_token_args`, then the support's values on the host (one copy; a sync).

    Raises ValueError naming the argument, row and slot of the first bad entry.

    Args:
        logits: [N, Vl] local shard.
        sampled_ids: [N] global ids.
        support_ids, support_logprobs, support_valid: [N, S].
        vocab_size: engine vocabulary size.
        tp_size: tensor-parallel world size.
        temperature: sampling temperature (> 0).
    """
    check_token_args(logits, sampled_ids, support_ids, support_logprobs, support_valid,
                     vocab_size=vocab_size, tp_size=tp_size, temperature=temperature)
    if logits.shape[0] == 0:
        return
    # One host copy of the small replicated arrays; the rules live in ops/support.py.
    check_support(
        support_ids.detach().cpu().numpy(), support_logprobs.detach().float().cpu().numpy(),
        support_valid.detach().cpu().numpy(), sampled_ids.detach().cpu().numpy(), vocab_size)
