"""CLI: `torchrun --nproc-per-node 2 -m megatron_pdm.train --config CONFIG.yaml`.

Needs the driver's extras (`pip install "megatron-pdm[all]"`). Example configs are in a source
checkout, not in the wheel: examples/tiny_cpu/config.yaml (the CPU demo, `make demo` there),
examples/real_cpu/, examples/qwen3_30b_a3b/; `--help` lists every key, so a config can also be
written from scratch (unknown keys are errors).

Flags: `--set dotted.key=value` (repeatable), `--preset NAME` (= --set loss.preset=NAME),
`--output-dir DIR`, `--resume` (continue from the newest complete checkpoint in DIR/checkpoints,
verified, or start fresh when there is none; docs/checkpoints.md), `--dry-run` (validate the
layout and print a memory estimate without initialising torch.distributed or allocating the model;
needs no torchrun), `--save-warmup DIR` (run only the supervised warm-up and save its weights to
DIR for `checkpoint.load_dir`). `--help` lists every config key by section.

Common mistakes get a one-line hint instead of a traceback (cli.run_cli): Megatron-LM flags such
as `--tp 4` name the `--set` key that does the same, and a training run started without torchrun
says how to start it.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_pdm.configtree import ConfigError

# Megatron-LM / slime flags -> the config key that does the same here.
MEGATRON_FLAGS = {
    "--tp": "parallel.tp", "--tensor-model-parallel-size": "parallel.tp",
    "--pp": "parallel.pp", "--pipeline-model-parallel-size": "parallel.pp",
    "--ep": "parallel.ep", "--expert-model-parallel-size": "parallel.ep",
    "--use-distributed-optimizer": "parallel.use_distributed_optimizer",
    "--lr": "train.lr", "--weight-decay": "train.weight_decay", "--clip-grad": "train.clip_grad",
    "--adam-beta1": "train.adam_beta1", "--adam-beta2": "train.adam_beta2",
    "--train-iters": "train.iterations", "--recompute-granularity": "train.recompute",
    "--seed": "seed", "--load": "checkpoint.load_dir", "--save": "output_dir",
    "--save-interval": "checkpoint.save_interval", "--bf16": "precision.params_dtype",
    "--fp8-format": "precision.fp8", "--fp8-recipe": "precision.fp8_recipe",
    "--seq-length": "rollout.max_sequence_length", "--tensorboard-dir": "log.tensorboard",
    "--wandb-project": "log.wandb_project", "--num-layers": "model.num_layers",
    "--hidden-size": "model.hidden_size", "--num-experts": "model.num_experts",
}
_FLAG_VALUES = {"--bf16": "bf16", "--use-distributed-optimizer": "true",
                "--tensorboard-dir": "true"}


def unknown_args_hint(unknown: list[str]) -> str:
    """One line for arguments argparse did not recognise, naming the --set key for known ones."""
    hints = []
    for i, arg in enumerate(unknown):
        flag, _, inline = arg.partition("=")
        key = MEGATRON_FLAGS.get(flag) or MEGATRON_FLAGS.get(flag.replace("_", "-"))
        if key is None:
            continue
        value = (_FLAG_VALUES.get(flag) or inline
                 or (unknown[i + 1] if i + 1 < len(unknown) and not
                     unknown[i + 1].startswith("--") else "VALUE"))
        hints.append(f"{arg if inline else flag} -> --set {key}={value}")
    msg = f"unrecognized arguments: {' '.join(unknown)}"
    if hints:
        msg += ("; this driver takes Megatron-LM settings as config keys: " + ", ".join(hints))
    return msg + (" (flags: --config, --set KEY=VALUE, --preset, --output-dir, --resume, "
                  "--dry-run, --save-warmup DIR)")


def config_keys_help() -> str:
    """Every config key by section, read from the config dataclasses (the one schema); each
    key's meaning is its field's docstring in megatron_pdm/train/config.py (the `rollout`
    section: megatron_pdm/train/rollout/config.py)."""
    import dataclasses
    import textwrap
    import typing

    from megatron_pdm.train.config import RunConfig

    lines: list[str] = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        keys = [*getattr(cls, "_config_aliases", ())]
        nested = []
        for f in dataclasses.fields(cls):
            if f.init:  # the keys from_mapping accepts (megatron_pdm/configtree.py)
                (nested if dataclasses.is_dataclass(hints[f.name]) else keys).append(f.name)
        if keys:
            head = f"{prefix}{{" if prefix else ""
            body = ", ".join(keys) + ("}" if prefix else "")
            lines.extend(textwrap.wrap(head + body, 96, initial_indent="  ",
                                       subsequent_indent="      "))
        for name in nested:
            walk(hints[name], f"{prefix}{name}.")

    walk(RunConfig, "")
    return ("config keys (--set KEY=VALUE or the --config yaml; each one documented in "
            "megatron_pdm/train/config.py, rollout.*: megatron_pdm/train/rollout/config.py):\n"
            + "\n".join(lines))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_pdm.train", description=__doc__,
                                epilog=config_keys_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="run config yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="dotted override, e.g. train.lr=3e-4")
    p.add_argument("--preset", default=None, help="loss preset (e.g. pdm-agg, grpo, drpo)")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the parallel layout, print a memory estimate, exit")
    p.add_argument("--save-warmup", default=None, metavar="DIR",
                   help="run only the warm-up; save its weights to DIR (checkpoint.load_dir)")
    args, unknown = p.parse_known_args(argv)
    if unknown:
        raise ConfigError(unknown_args_hint(unknown))
    return args


def check_launcher(cfg, env=None) -> None:
    """A training run is one process per rank: refuse a plain `python -m` start with the fix."""
    env = os.environ if env is None else env
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return
    from megatron_pdm.arch import min_world_size

    p = cfg.parallel
    n = min_world_size(tp=p.tp, pp=p.pp, ep=p.ep)
    raise ConfigError(
        f"python -m megatron_pdm.train runs one process per rank and needs torchrun: "
        f"torchrun --nproc-per-node {n} -m megatron_pdm.train {' '.join(sys.argv[1:])} "
        f"(parallel.tp={p.tp} x pp={p.pp} x ep={p.ep} needs {n} ranks; --dry-run needs no "
        "torchrun; in a source checkout `make demo` runs the CPU demo)")


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
    check_launcher(cfg)
    if cfg.log.wandb:
        from megatron_pdm.train.logging_utils import wandb_module

        wandb_module()  # a missing package is a one-line error before any process group
    from megatron_pdm.train.config import check_world
    from megatron_pdm.train.resume import check_before_start

    world = int(os.environ["WORLD_SIZE"])
    check_world(cfg, world)  # layout and batch rules: one line before the process group forms
    if not args.save_warmup:
        check_before_start(cfg, resume=args.resume, world_size=world)
    if args.save_warmup:
        from megatron_pdm.train.warmup_export import save_warmup

        save_warmup(cfg, args.save_warmup)
    else:
        from megatron_pdm.train.trainer import run_main

        run_main(cfg, resume=args.resume)
    from megatron_pdm.mcore.parallel import destroy_parallel

    destroy_parallel()
    return 0



def cli() -> int:
    """Console-script entry point (setup.py `entry_points`): `main` with ConfigError handling."""
    from megatron_pdm.cli import run_cli

    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
