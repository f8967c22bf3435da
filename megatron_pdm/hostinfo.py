"""The machine a number was measured on (stdlib only): the one CPU-model reader.

Results files (stability grid, mask study, simulation, benchmarks) record it beside their
thread count, since CPU results depend on the CPU.
"""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo; elsewhere platform's processor or machine, else
    "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


__all__ = ["cpu_model"]
