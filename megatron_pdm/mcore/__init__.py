"""megatron-core integration (imports megatron): model provider, parallel state, optimizer,
checkpoints, the CPU shim and the policy-loss adapter (`loss_adapter`).

megatron-core warns once per module and per rank when Apex or Transformer Engine is missing
("... not installed. Falling back to ..."): six near-identical warnings per process. Importing
this package routes exactly those warnings into a list instead of stderr; `fallback_summary()`
returns them de-duplicated, and the trainer logs that summary once, on rank 0. Every other warning
is shown as usual.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
import warnings

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def stub_triton_paged_stash() -> None:
    """megatron-core >= 0.19 imports triton at `import megatron.core` (schedules.py imports the MoE
    paged stash, whose kernels are triton; a GPU-only memory feature). Without triton (CPU torch)
    that import fails, so the one module is stubbed in `sys.modules` before any megatron import:
    same names, kernels that raise if ever called. Inert when triton is installed or on 0.16.1
    (which has no such module)."""
    if PAGED_STASH in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(PAGED_STASH)
    stub.GLOBAL_BLOCK_SIZE = 1024  # megatron-core 0.19.2's value

    def _needs_triton(*args, **kwargs):
        raise RuntimeError("megatron-core's MoE paged stash needs triton (a GPU build of torch)")

    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _needs_triton
    sys.modules[PAGED_STASH] = stub


stub_triton_paged_stash()

_FALLBACK = re.compile(r"(Apex|Transformer Engine).*not installed|Falling back to")
_seen: list[str] = []
_show = warnings.showwarning


def _showwarning(message, category, filename, lineno, file=None, line=None):
    if issubclass(category, UserWarning) and _FALLBACK.search(str(message)):
        if str(message) not in _seen:
            _seen.append(str(message))
        return
    _show(message, category, filename, lineno, file, line)


if warnings.showwarning is not _showwarning:
    warnings.showwarning = _showwarning


def fallback_summary() -> str | None:
    """One line naming megatron-core's Apex/TE fallbacks seen so far (None if there were none)."""
    if not _seen:
        return None
    parts = sorted({m.split("Falling back to", 1)[-1].strip().rstrip(".") for m in _seen})
    return "megatron-core without Apex/Transformer Engine falls back to: " + "; ".join(parts)
