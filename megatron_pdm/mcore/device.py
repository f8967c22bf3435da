"""The one device the driver computes on: `torch.cuda.current_device()`.

On a GPU that is the rank's CUDA device (set by `init_parallel` from LOCAL_RANK); under the CPU
shim (cpu_shim.py) `torch.cuda.current_device()` returns "cpu". There is no CPU-only branch: the
same calls place the model, the optimizer state and every batch on a GPU and on CPU.
"""

from __future__ import annotations

import dataclasses

import torch


def current_device() -> torch.device:
    """The rank's compute device (CUDA device index on a GPU, "cpu" under the CPU shim)."""
    d = torch.cuda.current_device()
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def place(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every parameter and buffer on the current device (in place; returned).

    megatron creates most weights there already (`use_cpu_initialization=False` on a GPU), but
    not modules built from plain torch (our `TorchRMSNorm`), and on CPU init nothing; the
    DistributedOptimizer's buffers would later move only the DDP-wrapped parameters.
    """
    return module.to(current_device())


def to_device(batch, device: torch.device | None = None):
    """A copy of dataclass `batch` with every tensor field on `device` (default: current).

    Non-tensor fields (temperature, version, ...) are kept; None stays None. The copy is
    non-blocking from pinned memory and a no-op for tensors already there.
    """
    device = current_device() if device is None else device
    moved = {f.name: getattr(batch, f.name).to(device, non_blocking=True)
             for f in dataclasses.fields(batch) if torch.is_tensor(getattr(batch, f.name))}
    return dataclasses.replace(batch, **moved)
