"""Shared CLI behaviour: a user's configuration mistake prints as one clean line, not a traceback.

Every entry point (`python -m megatron_pdm.train`, `megatron_pdm.train.compare`,
`megatron_pdm.tools.*`) wraps its `main` in `run_cli`. A `ConfigError` (bad key, bad value, inconsistent settings, a
layout that cannot work) is printed as `error: <message>` on stderr and the process exits with
status 2. Under torchrun (WORLD_SIZE > 1) every rank prints its own line, prefixed `[rank N]`, flushed
before it exits. Anything else
is a bug or an environment failure and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from megatron_pdm.configtree import ConfigError

EXIT_CONFIG_ERROR = 2


def run_cli(main: Callable[[list[str] | None], int | None],
            argv: list[str] | None = None) -> int:
    """Runs `main(argv)`; returns its exit code, or 2 after printing a ConfigError."""
    try:
        code = main(argv)
    except ConfigError as err:
        # every rank prints its own line: the first rank to exit makes torchrun end the others,
        # so a message printed by rank 0 alone could be lost
        rank = os.environ.get("RANK")
        multi = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
        prefix = f"[rank {rank}] " if rank is not None and multi else ""
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    return 0 if code is None else int(code)
