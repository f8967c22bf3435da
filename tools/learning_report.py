#!/usr/bin/env python3
"""`megatron-pdm-learning-report` from a checkout: `python tools/learning_report.py ARGS` runs what the installed console command
runs (megatron_pdm.tools.learning_report:main); no install needed beyond the dependencies (README)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from megatron_pdm.tools.learning_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
