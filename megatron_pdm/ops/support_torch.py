"""`fold_support` on torch tensors: the same fold as ops/support.py, on the tensors' device.

For a training loop that already holds the engine's top-K as tensors (its own rollouts, a
framework's batch): no host round trip, no numpy. The layout, the int32 narrowing guard and the
errors are those of `megatron_pdm.ops.support.fold_support` (docs/math.md §3.9); the result is
identical, element for element (tests/base/test_own_loop.py). `check_support` stays host-side
(`token_stats(validate=True)` runs it on the folded tensors).

Host syncs: one, for the int32 guard on ids wider than int32 (none for int32 ids).

Shape legend: T rows (tokens), K top-K entries, S = K + 1 support slots.
"""

from __future__ import annotations

import torch

from megatron_pdm.ops.support import SupportError

__all__ = ["fold_support_torch"]

_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def _check(top_ids_TK, top_valid_TK, sampled_ids_T) -> None:
    for what, t, ok in (("support_ids", top_ids_TK, not t_is_float_or_bool(top_ids_TK)),
                        ("sampled_ids", sampled_ids_T, not t_is_float_or_bool(sampled_ids_T)),
                        ("support_valid", top_valid_TK, top_valid_TK.dtype == torch.bool)):
        if not ok:
            expected = "bool" if what == "support_valid" else "an integer dtype"
            raise SupportError(f"dtype {t.dtype} is not {expected}", what=what)
    if top_ids_TK.dim() != 2 or tuple(top_valid_TK.shape) != tuple(top_ids_TK.shape) \
            or tuple(sampled_ids_T.shape) != (top_ids_TK.shape[0],):
        raise SupportError(f"shapes: top ids {tuple(top_ids_TK.shape)}, valid "
                           f"{tuple(top_valid_TK.shape)}, sampled {tuple(sampled_ids_T.shape)} "
                           "are not [T, K], [T, K], [T]")
    for what, ids, valid in (("support_ids", top_ids_TK, top_valid_TK),
                             ("sampled_ids", sampled_ids_T, None)):
        if ids.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
            continue
        bad = (ids < _INT32_MIN) | (ids > _INT32_MAX)
        if valid is not None:
            bad = bad & valid
        if bool(bad.any()):  # the one host sync (ids wider than int32 only)
            cell = [int(i) for i in bad.nonzero()[0]]
            raise SupportError(f"id {int(ids[tuple(cell)])} out of range: does not fit int32 "
                               "(the support's dtype)", cell[0],
                               cell[1] if len(cell) > 1 else None, what=what)


def t_is_float_or_bool(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool or t.is_floating_point() or t.is_complex()


def fold_support_torch(top_ids_TK: torch.Tensor, top_lp_TK: torch.Tensor,
                       top_valid_TK: torch.Tensor, sampled_ids_T: torch.Tensor,
                       sampled_lp_T: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Folds the sampled token into the top-K support (ops/support.py's layout).

    Args:
        top_ids_TK: [T, K] int top-K ids in rank order (any value on invalid slots).
        top_lp_TK: [T, K] float top-K logprobs.
        top_valid_TK: [T, K] bool.
        sampled_ids_T: [T] int sampled ids.
        sampled_lp_T: [T] float sampled-token logprobs (independently returned).

    Returns:
        (support_ids [T, K+1] int32, support_logprobs [T, K+1] fp32, support_valid [T, K+1]
        bool, a 0-dim int64 tensor: positions whose sampled token was inside the top-K), on the
        inputs' device.

    Raises:
        SupportError: an id tensor of a float or bool dtype, a mask that is not bool, shapes
            that do not match, or a valid top-K id or a sampled id outside int32.
    """
    _check(top_ids_TK, top_valid_TK, sampled_ids_T)
    t, k = top_ids_TK.shape
    dev = top_ids_TK.device
    match_TK = (top_ids_TK.long() == sampled_ids_T.long()[:, None]) & top_valid_TK
    inside_T = match_TK.any(-1)
    ids_TS = torch.zeros(t, k + 1, dtype=torch.int32, device=dev)
    lp_TS = torch.full((t, k + 1), -torch.inf, dtype=torch.float32, device=dev)
    valid_TS = torch.zeros(t, k + 1, dtype=torch.bool, device=dev)
    ids_TS[:, :k] = torch.where(top_valid_TK, top_ids_TK, 0).to(torch.int32)
    top_lp32_TK = torch.where(top_valid_TK, top_lp_TK, -torch.inf).to(torch.float32)
    sampled_lp32_T = sampled_lp_T.to(torch.float32)
    # the sampled token's slot holds its independently returned logprob
    lp_TS[:, :k] = torch.where(match_TK, sampled_lp32_T[:, None], top_lp32_TK)
    valid_TS[:, :k] = top_valid_TK
    ids_TS[:, k] = torch.where(inside_T, 0, sampled_ids_T).to(torch.int32)
    lp_TS[:, k] = torch.where(inside_T, -torch.inf, sampled_lp32_T)
    valid_TS[:, k] = ~inside_T
    return ids_TS, lp_TS, valid_TS, inside_T.sum()
