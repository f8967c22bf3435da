"""megatron-core integration (imports megatron): model provider, parallel state, optimizer,
checkpoints, the CPU shim and the policy-loss adapter (`loss_adapter`).

megatron-core warns once per module and per rank when Apex or Transformer Engine is missing
("... not installed. Falling back to ..."): six near-identical warnings per process. Importing
this package routes exactly those warnings into a list instead of stderr; `fallback_summary()`
returns them de-duplicated, and the trainer logs that summary once, on rank 0. Every other warning
is shown as usual.
"""

from __future__ import annotations

import re
import warnings

from megatron_pdm.triton_stub import PAGED_STASH, stub_triton_paged_stash  # noqa: F401

stub_triton_paged_stash()  # (also done by `import megatron_pdm`; idempotent)

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
