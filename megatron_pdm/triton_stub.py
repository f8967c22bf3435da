"""The triton stand-in for megatron-core >= 0.19 on a machine without triton (CPU torch).

Installed by `import megatron_pdm` (the package root), so it is in place before megatron-core
is imported by any code that reaches megatron through this package, in whatever order the
modules of a process import each other: a spawned test worker that imports
`megatron.core.tensor_parallel` first still imported `megatron_pdm` when its function was
unpickled (its module imports the package), and every entry point is a `megatron_pdm` module.
A process that imports megatron-core before anything of this package fails exactly as it does
without this package (megatron-core 0.19 itself needs triton); only an interpreter start-up hook
(a .pth file) could reach it, and that would patch every Python process of a user's
environment, so there is none.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def stub_triton_paged_stash() -> None:
    """megatron-core >= 0.19 imports triton at `import megatron.core` (schedules.py imports the MoE
    paged stash, whose kernels are triton; a GPU-only memory feature). Without triton (CPU torch)
    that import fails, so the one module is stubbed in `sys.modules` before any megatron import:
    same names, kernels that raise if ever called. Inert when triton is installed or on 0.16.1
    (which has no such module)."""
    if PAGED_STASH in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    # Only where the installed megatron-core has the module (0.19+): found on disk, without
    # importing megatron (whose import is what needs the stub).
    spec = importlib.util.find_spec("megatron")
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    tail = PAGED_STASH.split(".")[1:]
    if not any(os.path.exists(os.path.join(d, *tail) + ".py") for d in where):
        return
    stub = types.ModuleType(PAGED_STASH)
    stub.GLOBAL_BLOCK_SIZE = 1024  # megatron-core 0.19.2's value

    def _needs_triton(*args, **kwargs):
        raise RuntimeError("megatron-core's MoE paged stash needs triton (a GPU build of torch)")

    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _needs_triton
    sys.modules[PAGED_STASH] = stub
