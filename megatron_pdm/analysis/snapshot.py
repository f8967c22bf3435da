"""Exact snapshot, restore and verification of a megatron model + optimizer state (this rank's).

The study takes one optimizer step per criterion FROM THE SAME STATE, so the state is copied once
and written back before every step. What a megatron step reads and writes:

- the module's parameters and buffers (they live in DDP's contiguous param buffers; copied in
  place so the buffers keep their storage),
- each leaf optimizer's torch optimizer (`mopt.sub_optimizers`): its params (the main params:
  views of the fp32 model params, or separate fp32 copies of bf16 ones, or the
  DistributedOptimizer's fp32 shards), its per-param state (Adam's exp_avg, exp_avg_sq, step)
  and its param-group hyperparameters,
- the RNG states (torch CPU; CUDA and megatron's tracker where present), in case a layer draws
  random numbers.

Gradient buffers are not saved: every step zeroes them first (train/schedule.py).
`verify_snapshot` compares every saved tensor with the live one bit for bit and names the ones
that differ; the study calls it after each restore-round (and re-evaluates the batch too).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from megatron_pdm.mcore import optimizer as mopt

__all__ = ["StateSnapshot", "restore_snapshot", "take_snapshot", "verify_snapshot"]


@dataclass
class StateSnapshot:
    """Copies (on `device`) of everything one optimizer step changes on this rank."""

    module: dict[str, torch.Tensor]
    main_params: list[list[torch.Tensor]]
    opt_state: list[list[dict]]
    param_groups: list[list[dict]]
    rng: dict


def _module(ddp_model) -> torch.nn.Module:
    return getattr(ddp_model, "module", ddp_model)


def _module_tensors(ddp_model) -> dict[str, torch.Tensor]:
    m = _module(ddp_model)
    out = {f"param:{n}": p for n, p in m.named_parameters()}
    out.update({f"buffer:{n}": b for n, b in m.named_buffers() if b is not None})
    return out


def _torch_optimizers(optimizer) -> list:
    return [o.optimizer for o in mopt.sub_optimizers(optimizer) if o.optimizer is not None]


def _params(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _copy_value(v, device):
    return v.detach().to(device, copy=True) if torch.is_tensor(v) else copy.deepcopy(v)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["tracker"] = copy.deepcopy(get_cuda_rng_tracker().get_states())
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(copy.deepcopy(state["tracker"]))


@torch.no_grad()
def take_snapshot(ddp_model, optimizer, *, device: str | torch.device = "cpu") -> StateSnapshot:
    """Copies this rank's model + optimizer state to `device` (cpu by default: no extra
    accelerator memory; restore copies back)."""
    module = {k: v.detach().to(device, copy=True) for k, v in _module_tensors(ddp_model).items()}
    main, states, groups = [], [], []
    for opt in _torch_optimizers(optimizer):
        params = _params(opt)
        main.append([p.detach().to(device, copy=True) for p in params])
        states.append([{k: _copy_value(v, device) for k, v in opt.state.get(p, {}).items()}
                       for p in params])
        groups.append([{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                       for g in opt.param_groups])
    return StateSnapshot(module, main, states, groups, _rng_state())


def _restore_param_state(opt, p: torch.Tensor, saved: dict) -> None:
    live = opt.state.get(p)
    same = (live is not None and set(live) == set(saved) and all(
        torch.is_tensor(live[k]) == torch.is_tensor(v)
        and (not torch.is_tensor(v) or live[k].shape == v.shape) for k, v in saved.items()))
    if not same:
        opt.state[p] = {k: (v.to(p.device, copy=True) if torch.is_tensor(v) else copy.deepcopy(v))
                        for k, v in saved.items()}
        return
    for k, v in saved.items():  # in place: keeps any aliasing the optimizer relies on
        if torch.is_tensor(v):
            live[k].copy_(v)
        else:
            live[k] = copy.deepcopy(v)


@torch.no_grad()
def restore_snapshot(snap: StateSnapshot, ddp_model, optimizer) -> None:
    """Writes the snapshot back in place (model first, then the optimizers' main params)."""
    live = _module_tensors(ddp_model)
    if set(live) != set(snap.module):
        raise RuntimeError("restore_snapshot: the model's parameter/buffer names changed since "
                           "the snapshot")
    for k, v in snap.module.items():
        live[k].copy_(v)
    opts = _torch_optimizers(optimizer)
    if len(opts) != len(snap.main_params):
        raise RuntimeError(f"restore_snapshot: {len(opts)} optimizers, snapshot has "
                           f"{len(snap.main_params)}")
    for opt, main, states, groups in zip(opts, snap.main_params, snap.opt_state,
                                         snap.param_groups):
        params = _params(opt)
        for p, saved_p, saved_state in zip(params, main, states, strict=True):
            p.copy_(saved_p)
            _restore_param_state(opt, p, saved_state)
        for g, saved_g in zip(opt.param_groups, groups, strict=True):
            g.update(copy.deepcopy(saved_g))
    _set_rng_state(snap.rng)


def _differs(a, b) -> bool:
    if torch.is_tensor(a) != torch.is_tensor(b):
        return True
    if torch.is_tensor(a):
        return a.shape != b.shape or not torch.equal(a.detach().cpu(), b.detach().cpu())
    return a != b


def verify_snapshot(snap: StateSnapshot, ddp_model, optimizer) -> list[str]:
    """Names of every live tensor / state entry that differs from the snapshot (empty: exact)."""
    bad = [k for k, v in _module_tensors(ddp_model).items() if _differs(v, snap.module[k])]
    for i, (opt, main, states) in enumerate(zip(_torch_optimizers(optimizer), snap.main_params,
                                                snap.opt_state)):
        for j, (p, saved_p, saved_state) in enumerate(zip(_params(opt), main, states)):
            if _differs(p, saved_p):
                bad.append(f"optimizer[{i}].param[{j}]")
            live = opt.state.get(p, {})
            for k in set(live) | set(saved_state):
                if k not in live or k not in saved_state or _differs(live[k], saved_state[k]):
                    bad.append(f"optimizer[{i}].state[{j}].{k}")
    return bad
