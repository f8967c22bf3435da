"""Checks of megatron_pdm.integrations.verl against the real verl 0.9.1, marker `verl`.

A plugin of tests/conftest.py: any test marked `verl` is skipped (or, under PDM_REQUIRE_VERL=1,
fails the run) where the env is missing.

`make test` builds the verl env first (scripts/verl_env.sh: verl 0.9.1 and the modules its loss
code imports, exact pins, --no-deps, into .cache/verl-env/site on top of the project venv).
The checks run in one subprocess with that PYTHONPATH (tests/integrations/verl_checks.py).

Skips: only when the env is missing (the script failed or was not run); PDM_REQUIRE_VERL=1 turns
that skip into a failure (`make test` sets it where the script succeeded).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "verl: checks against the installed verl 0.9.1 env "
                                       "(scripts/verl_env.sh)")


def verl_pythonpath() -> str | None:
    """PYTHONPATH of the installed verl env, or None."""
    base = Path(os.environ.get("VERL_ENV") or ROOT / ".cache" / "verl-env")
    if not ((base / ".stamp").exists() and (base / "pythonpath").exists()):
        return None
    return (base / "pythonpath").read_text().strip()


def env_problem() -> str | None:
    if verl_pythonpath() is None:
        return ("verl 0.9.1 env missing under .cache/verl-env (create it with "
                "scripts/verl_env.sh; `make test` does)")
    return None


def pytest_collection_modifyitems(config, items):
    wanted = [i for i in items if i.get_closest_marker("verl") is not None]
    problem = env_problem()
    if not wanted or problem is None:
        return
    if os.environ.get("PDM_REQUIRE_VERL") == "1":
        raise pytest.UsageError(f"PDM_REQUIRE_VERL=1 but {problem}")
    for item in wanted:
        item.add_marker(pytest.mark.skip(reason=problem))
