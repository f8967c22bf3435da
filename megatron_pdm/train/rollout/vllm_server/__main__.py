"""`python -m megatron_pdm.train.rollout.vllm_server ARGS`: the launcher's CLI (cli.py)."""

import sys

from megatron_pdm.train.rollout.vllm_server.cli import cli

sys.exit(cli())
