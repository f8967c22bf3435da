#!/usr/bin/env python3
"""`megatron-pdm-eval-heldout` from a checkout: `python tools/eval_heldout.py ARGS` runs what the installed console command
runs (megatron_pdm.tools.eval_heldout:cli); no install needed beyond the dependencies (README)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from megatron_pdm.tools.eval_heldout import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
