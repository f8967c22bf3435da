#!/usr/bin/env python3
"""`megatron-pdm-prepare-real-model` from a checkout: `python tools/prepare_real_model.py ARGS` runs what the installed console command
runs (megatron_pdm.tools.prepare_real_model:main); no install needed beyond the dependencies (README)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from megatron_pdm.tools.prepare_real_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
