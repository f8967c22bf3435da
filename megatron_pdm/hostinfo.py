"""The machine a number was measured on (stdlib only): the one CPU-model reader.

Results files (stability grid, mask study, simulation, benchmarks) record it beside their
thread count, since CPU results depend on the CPU. The model name alone does not say which
kernels ran: two machines that both report "AMD EPYC" gave different warm-ups with the same
command (docs/stability.md; what differed between them was not recorded), so `cpu_id` adds
family / model / stepping and `kernel_isa` the instruction set torch dispatches its CPU kernels
to.
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


def _cpuinfo_fields(names: tuple[str, ...]) -> dict[str, str]:
    """The first processor's values of `names` in /proc/cpuinfo ({} without it)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends at the first blank line
                key, _, value = line.partition(":")
                key = key.strip()
                if key in names and key not in found:
                    found[key] = value.strip()
    except OSError:
        pass
    return found


def cpu_id() -> str:
    """"family F model M stepping S" of the CPU (x86 /proc/cpuinfo), else platform.machine()."""
    f = _cpuinfo_fields(("cpu family", "model", "stepping"))
    if f:
        return " ".join(f"{k.replace('cpu ', '')} {f[k]}" for k in ("cpu family", "model",
                                                                    "stepping") if k in f)
    return platform.machine() or "unknown"


def kernel_isa() -> str:
    """The instruction set torch's CPU kernels dispatch to ("AVX512", "AVX2", "DEFAULT", ...);
    "n/a" when torch is not imported yet (this module imports nothing outside the stdlib)."""
    import sys

    torch = sys.modules.get("torch")
    try:
        return str(torch.backends.cpu.get_cpu_capability()) if torch is not None else "n/a"
    except (AttributeError, RuntimeError):
        return "unknown"


def machine() -> dict:
    """What a results file records of the CPU: model name, id, torch's kernel ISA, core count."""
    import os

    return {"cpu_model": cpu_model(), "cpu_id": cpu_id(), "kernel_isa": kernel_isa(),
            "cpu_count": os.cpu_count()}


__all__ = ["cpu_id", "cpu_model", "kernel_isa", "machine"]
