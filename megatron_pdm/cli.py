"""Shared CLI behaviour: a user's configuration mistake prints as one clean line, not a traceback.

Every entry point (`python -m megatron_pdm.train`, `megatron_pdm.train.compare`,
`megatron_pdm.tools.*`) wraps its `main` in `run_cli`. A `ConfigError` (bad key, bad value, inconsistent settings, a
layout that cannot work) is printed as `error: <message>` on stderr and the process exits with
status 2. Under torchrun every rank parses the same config, so only rank 0 prints. Anything else
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
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    return 0 if code is None else int(code)
