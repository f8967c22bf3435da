"""CLI: `torchrun --nproc-per-node 2 -m megatron_pdm.train --config examples/tiny_cpu/config.yaml`.

Flags: `--set dotted.key=value` (repeatable), `--preset NAME` (= --set loss.preset=NAME),
`--output-dir DIR`, `--resume` (continue from the latest checkpoint in DIR/checkpoints, or start
fresh when there is none), `--dry-run` (validate the layout and print a memory estimate without
initialising torch.distributed or allocating the model).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_pdm.train", description=__doc__)
    p.add_argument("--config", default=None, help="run config yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="dotted override, e.g. train.lr=3e-4")
    p.add_argument("--preset", default=None, help="loss preset (e.g. pdm-agg, grpo, drpo)")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the parallel layout, print a memory estimate, exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_pdm.train.config import RunConfig

    overrides = list(args.overrides)
    if args.preset:
        overrides.append(f"loss.preset={args.preset}")
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    cfg = RunConfig.load(args.config, overrides)
    from megatron_pdm.train.logging_utils import setup_logging

    setup_logging()
    if args.dry_run:
        from megatron_pdm.train.dry_run import dry_run

        return dry_run(cfg)
    from megatron_pdm.train.trainer import run_main

    run_main(cfg, resume=args.resume)
    from megatron_pdm.mcore.parallel import destroy_parallel

    destroy_parallel()
    return 0


if __name__ == "__main__":
    from megatron_pdm.cli import run_cli

    sys.exit(run_cli(main))
