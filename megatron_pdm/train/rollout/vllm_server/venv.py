"""Where the vLLM environment is, and which vLLM release it holds (checked before a start).

The server runs in its own venv (`.venv-vllm`, scripts/setup_vllm_cpu.sh): `$VLLM_VENV`, else
`<repo>/.venv-vllm` in a source checkout, else `./.venv-vllm` (an installed wheel).
`installed_vllm_version` asks that interpreter for its vLLM release and refuses one outside the
supported range (rollout_bridge/vllm/versions.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
"""The repository root of a source checkout (the site-packages directory of an installed wheel)."""
VENV_ENV = "VLLM_VENV"  # the vLLM venv's path, overriding the default below


def default_venv(root: Path = ROOT) -> Path:
    """<repo>/.venv-vllm in a source checkout (where scripts/setup_vllm_cpu.sh puts it);
    ./.venv-vllm of the working directory for an installed wheel (never inside site-packages)."""
    if (root / "setup.py").exists() and (root / "megatron_pdm").is_dir():
        return root / ".venv-vllm"
    return Path.cwd() / ".venv-vllm"



def vllm_python(venv: str | os.PathLike | None = None) -> Path:
    """The vLLM venv's interpreter: `venv`, else $VLLM_VENV, else `default_venv()`."""
    return Path(venv or os.environ.get(VENV_ENV) or default_venv()) / "bin" / "python"


def installed_vllm_version(python: str | os.PathLike) -> str:
    """The vLLM release installed for interpreter `python`, checked against the supported range.

    Asks the interpreter itself (`python -I -c rollout_bridge.vllm.versions.PROBE`: the installed
    distributions' metadata, without importing vLLM), so it is the release the server would run.

    Raises:
        UnsupportedVLLMVersion: no vLLM installed there, or a release outside the range of
            rollout_bridge/vllm/versions.py; the message names the interpreter and the version.
    """
    from rollout_bridge.vllm.versions import (
        PROBE,
        UnsupportedVLLMVersion,
        check_vllm_version,
        supported_text,
    )

    where = f"the vLLM environment {python}"
    try:
        out = subprocess.run([str(python), "-I", "-c", PROBE], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        raise UnsupportedVLLMVersion(f"{where}: its vLLM version cannot be read ({err})") from None
    if found is None:
        raise UnsupportedVLLMVersion(f"{where}: its vLLM version cannot be read (exit "
                                     f"{out.returncode}: {out.stderr.strip()[-300:]})")
    if not isinstance(found, dict) or not found:
        raise UnsupportedVLLMVersion(f"{where}: no vLLM installed (supported: vLLM "
                                     f"{supported_text()}; scripts/setup_vllm_cpu.sh)")
    if len(set(found.values())) > 1:
        raise UnsupportedVLLMVersion(f"{where}: several vLLM distributions installed ({found}); "
                                     "keep one")
    name, version = sorted(found.items())[0]
    check_vllm_version(version, f"{where} ({name})")
    return version
