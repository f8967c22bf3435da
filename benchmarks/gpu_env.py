"""The environment record of benchmarks/gpu_check.py's JSON: Python, torch, CUDA, the device and
its NCCL, megatron-core's version (each "missing"/None where absent, never an error)."""

from __future__ import annotations

import sys

__all__ = ["environment"]


def environment() -> dict:
    env = {"python": sys.version.split()[0]}
    try:
        import torch

        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            env.update(device=torch.cuda.get_device_name(0),
                       capability=list(torch.cuda.get_device_capability(0)))
            try:
                env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception as err:  # noqa: BLE001
                env["nccl"] = f"unknown ({err})"
    except ImportError as err:
        env["torch"] = f"missing: {err}"
    try:
        from importlib.metadata import version

        env["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001
        env["megatron_core"] = None
    return env
