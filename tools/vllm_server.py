#!/usr/bin/env python3
"""`megatron-pdm-vllm-server` from a checkout: `python tools/vllm_server.py ARGS` runs what the installed console command
runs (megatron_pdm.train.rollout.vllm_server.cli:cli); no install needed beyond the dependencies (README)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from megatron_pdm.train.rollout.vllm_server.cli import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
