"""Token-level mask study: does the predictive direction keep fewer unsafe updates?

(examples/tiny_cpu/config.yaml and runs/ are those of a source checkout after `make demo`; with
the wheel, pass your own run's config and run directory.)

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m megatron_pdm.tools.analyze_masks \
        --config examples/tiny_cpu/config.yaml --run-dir runs/tiny_cpu --out-dir runs/masks \
        [--checkpoint runs/tiny_cpu/checkpoints/iter_0000050] [--batches fresh|saved] \
        [--seeds 1 2 ... | --num-seeds 20] [--criteria ratio pdm-agg pdm-uniform pdm-exact]
        [--delta-kl 0.15] [--minibatch J] [--set dotted.key=value ...]

For each seed: from the checkpoint's model AND optimizer state, compute D (Top-K KL), the masks
and Ddot of each direction criterion on the same tokens, take one real optimizer step per
criterion from the same state, recompute D against the stored behaviour policy, and count the
kept out-of-region tokens whose D grew (the unsafe-keep rate), the disagreement set and the sign
accuracy of the first-order prediction; then paired win counts and bootstrap intervals over
seeds. Same code at any layout (TP/EP/DP/PP: run it with the run's torchrun layout, overridable
with --set parallel.tp=...). Writes results.json, results.md, tokens.npz, paired.png,
predicted_vs_realised.png and global_term.png into --out-dir (rank 0).

The library is megatron_pdm/analysis/ (study.py documents what a seed is); this file only parses
the flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None):
    from megatron_pdm.analysis.criteria import CRITERIA, DEFAULT_CRITERIA

    p = argparse.ArgumentParser(prog="megatron-pdm-analyze-masks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="the run's config yaml (default: the one stored with the "
                                    "run's saved rollouts)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="run-config override, e.g. rollout.prompts_per_iteration=128")
    p.add_argument("--run-dir", help="the driver's output dir (checkpoints/, rollouts/)")
    p.add_argument("--checkpoint", help="a dist checkpoint dir (default: the run's latest)")
    p.add_argument("--batches", choices=("fresh", "saved"), default="fresh",
                   help="fresh: one new rollout batch per seed from the configured engine; "
                        "saved: every batch the driver saved (log.save_rollouts) is one seed")
    p.add_argument("--rollouts", help="dir of saved batches (default: <run-dir>/rollouts)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=int, nargs="+", help="fresh-batch seeds")
    seeds.add_argument("--num-seeds", type=int, default=None, help="seeds 1..N (default 20)")
    p.add_argument("--criteria", nargs="+", default=list(DEFAULT_CRITERIA),
                   choices=list(CRITERIA), help="direction criteria to compare")
    p.add_argument("--delta-kl", type=float, default=0.15, help="δ of the Top-K KL criteria")
    p.add_argument("--delta-tv", type=float, default=0.2, help="δ of the Top-K TV criteria")
    p.add_argument("--minibatch", type=int, default=None,
                   help="study minibatch j of the rollout batch, after the driver's steps on "
                        "0..j-1 (default: the last one)")
    p.add_argument("--tol", type=float, default=0.0,
                   help="dead zone: |ΔD| <= tol counts as neither growing nor shrinking")
    p.add_argument("--stats-dtype", choices=("fp64", "fp32"), default="fp64",
                   help="dtype of the evaluated statistics (fp64: resolves the ~1e-7 changes of "
                        "near-deterministic tokens; fp32: half the memory on large vocabularies)")
    p.add_argument("--adam-state", choices=("checkpoint", "fresh"), default="checkpoint",
                   help="checkpoint: the run's optimizer state (Adam moments); fresh: model "
                        "only, Adam starts empty (a layout whose optimizer state the checkpoint "
                        "cannot reshard to, or an ablation without the run's momentum)")
    p.add_argument("--source", choices=("drift", "precision", "stale"), default="drift",
                   help="where out-of-region tokens come from: drift inside the iteration "
                        "(study minibatch: the last), the engine copy's precision (minibatch 0; "
                        "pick it with --rollout-precision), or staleness (minibatch 0 of a batch "
                        "--stale-iterations driver iterations old)")
    p.add_argument("--rollout-precision", choices=("fp32", "bf16", "fp8"),
                   help="the engine copy's precision (= --set rollout.rollout_precision=...)")
    p.add_argument("--stale-iterations", type=int, default=1,
                   help="--source stale: driver iterations between generation and study")
    p.add_argument("--sgd-lr", type=float, default=1e-4,
                   help="step size of the own-gradient control (plain SGD on each criterion's "
                        "masked loss); the zero-gradient (momentum-only) control runs with it")
    p.add_argument("--no-controls", action="store_true",
                   help="skip the decomposition controls (needed at DP > 1 with the "
                        "DistributedOptimizer)")
    p.add_argument("--design", choices=("paired", "runs"), default="paired",
                   help="paired: one step per criterion from the same state; runs: each "
                        "criterion's own training run from the same start, measured at every "
                        "step (--run-iterations)")
    p.add_argument("--run-iterations", type=int, default=3,
                   help="--design runs: RL iterations per criterion's run")
    p.add_argument("--power-effect", type=float, default=None, metavar="DIFF",
                   help="power analysis: the paired difference to detect (e.g. -0.027 for "
                        "-2.7 pp); with --power-sd or --pilot, the seeds are 1..n it gives "
                        "(unless --seeds / --num-seeds are given: then it is printed only)")
    p.add_argument("--power-sd", type=float, default=None,
                   help="power analysis: per-seed SD of the paired differences")
    p.add_argument("--pilot", default=None,
                   help="power analysis: a pilot study's results.json (its per-seed SD)")
    p.add_argument("--first-seed", type=int, default=None, metavar="K",
                   help="seeds K..K+n-1, n from the power analysis or --num-seeds (a study "
                        "after an independent pilot: K above the pilot's seeds)")
    p.add_argument("--primary", default=None, metavar="CRITERION:BASELINE[:RATE]",
                   help="the pre-registered primary comparison, named before the run (default "
                        "pdm-agg:ratio:unsafe_keep_rate); marked in the results")
    p.add_argument("--controls", nargs="?", const="", default=None, metavar="BASE",
                   help="synthetic controls (megatron_pdm/analysis/controls.py): an oracle that "
                        "sets --control-flip of BASE's wrong decisions right (positive) and a "
                        "copy of BASE (negative), compared against BASE with the rest (default "
                        "BASE: the primary comparison's baseline)")
    p.add_argument("--control-flip", type=float, default=0.5,
                   help="--controls: the oracle's probability of setting a wrong decision right")
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out-dir", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_pdm.analysis.study import StudyArgs, run_study
    from megatron_pdm.mcore.parallel import destroy_parallel
    from megatron_pdm.train.logging_utils import setup_logging

    setup_logging()
    from megatron_pdm.analysis.inference import DEFAULT_PRIMARY, parse_primary

    primary = args.primary or DEFAULT_PRIMARY
    power = _power(args, parse_primary(primary)[0])
    seeds = _seeds(args, power)
    if power is not None and args.pilot:
        from megatron_pdm.analysis.power import check_independent

        check_independent(args.pilot, power["pilot_seeds"], seeds)
    if power is not None:
        print(f"power analysis: {power['t_test']} seeds (normal approximation "
              f"{power['normal']}) for a paired difference of {power['effect']:+g} at SD "
              f"{power['sd']:g} ({power['sd_source']}), alpha {power['alpha']}, power "
              f"{power['power']}; running {len(seeds)}", flush=True)
    if args.rollout_precision:
        args.overrides.append(f"rollout.rollout_precision={args.rollout_precision}")
    study = StudyArgs(out_dir=args.out_dir, config=args.config, overrides=args.overrides,
                      run_dir=args.run_dir, checkpoint=args.checkpoint, batches=args.batches,
                      rollouts=args.rollouts, seeds=seeds, criteria=args.criteria,
                      delta_kl=args.delta_kl, delta_tv=args.delta_tv, minibatch=args.minibatch,
                      tol=args.tol, bootstrap_seed=args.bootstrap_seed,
                      plots=not args.no_plots, stats_dtype=args.stats_dtype,
                      adam_state=args.adam_state, source=args.source,
                      stale_iterations=args.stale_iterations,
                      sgd_lr=None if args.no_controls else args.sgd_lr, design=args.design,
                      run_iterations=args.run_iterations, power=power, primary=primary,
                      controls=(None if args.controls is None else
                                args.controls or parse_primary(primary)[1]),
                      control_flip=args.control_flip)
    try:
        result = run_study(study)
        if result is not None:
            print((Path(args.out_dir) / "results.md").read_text(), flush=True)
    finally:
        destroy_parallel()
    return 0


def _seeds(args, power: dict | None) -> list[int]:
    """--seeds; else K..K+n-1 (K = --first-seed or 1; n = --num-seeds, else the power
    analysis' t-test count, else 20)."""
    from megatron_pdm.configtree import ConfigError

    if args.seeds:
        if args.first_seed is not None:
            raise ConfigError("--first-seed with --seeds: give one of them")
        return args.seeds
    n = args.num_seeds or (power["t_test"] if power is not None else 20)
    first = 1 if args.first_seed is None else args.first_seed
    return list(range(first, first + n))


def _power(args, criterion: str | None = None) -> dict | None:
    """The power analysis of --power-effect with --power-sd or --pilot (None without it); the
    pilot's SD is the one of `criterion`'s paired difference (the primary comparison)."""
    from megatron_pdm.analysis.power import pilot_sd, pilot_seeds, seeds_needed
    from megatron_pdm.configtree import ConfigError

    if args.power_effect is None:
        if args.power_sd is not None or args.pilot:
            raise ConfigError("--power-sd / --pilot need --power-effect (the difference to "
                              "detect)")
        return None
    if (args.power_sd is None) == (not args.pilot):
        raise ConfigError("--power-effect needs exactly one of --power-sd and --pilot")
    if args.pilot:
        sd, n = pilot_sd(args.pilot, criterion)
        used = pilot_seeds(args.pilot)
        source = f"measured on the pilot {args.pilot}, {n} seeds ({min(used)}-{max(used)})"
        return dict(seeds_needed(args.power_effect, sd), sd_source=source, pilot_seeds=used)
    return dict(seeds_needed(args.power_effect, args.power_sd), sd_source="stated")


def cli() -> int:
    """Console-script entry point (setup.py `entry_points`): `main` with ConfigError handling."""
    from megatron_pdm.cli import run_cli

    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
