"""megatron-pdm-stability: the trust-region stability grid (docs/stability.md).

    megatron-pdm-stability --output-dir results/stability/full \
        [--methods ...] [--settings ...] [--seeds 1 2 3] [--smoke] [--set key=value]

Runs the shared warm-up once, then every (method, setting, seed) cell as its own driver run
(skipping cells already in records.jsonl), then writes results.json, results.md, curves.png.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from megatron_pdm.stability import grid as G
from megatron_pdm.stability import report, run
from megatron_pdm.stability import summary as S

DEFAULT_CONFIG = os.path.join("examples", "tiny_cpu", "config.yaml")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"run config (default: {DEFAULT_CONFIG}, relative to a source checkout's "
                        "root; the wheel ships no examples: pass your own)")
    p.add_argument("--output-dir", default="results/stability/full")
    p.add_argument("--methods", nargs="+", default=None,
                   help=f"default: all ({', '.join(G.METHODS)}); --smoke: {G.SMOKE_METHODS}")
    p.add_argument("--settings", nargs="+", default=None,
                   help=f"default: {', '.join(G.DEFAULT_SETTINGS)}; --smoke: {G.SMOKE_SETTINGS}")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 1 2 3; "
                   "--smoke: 1 2")
    p.add_argument("--baseline", default="no-trust-region")
    p.add_argument("--outcomes", nargs="+", default=list(S.DEFAULT_OUTCOMES),
                   help=f"end outcomes compared against the baseline (known: "
                        f"{', '.join(S.END_OUTCOMES)}); reporting only, no run changes")
    p.add_argument("--primary", default=None,
                   help="the pre-registered primary outcome: its rows form their own Holm "
                        "family (the other rows a secondary one); default: one family")
    p.add_argument("--smoke", action="store_true",
                   help="CI size: 2 iterations, small batches, a 10-step warm-up")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="extra driver overrides for every run (after the grid's sizes)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=None,
                   help="cells run side by side, each its own driver process (default: the CPU "
                        "count // (nproc x threads); a cell's numbers do not depend on it; "
                        "settings with an engine server start one server per running cell)")
    p.add_argument("--report-only", action="store_true", help="rewrite the results from "
                   "records.jsonl without running anything")
    p.add_argument("--rerecord", action="store_true", help="with --report-only: first rebuild "
                   "records.jsonl from the run folders (runs/<cell>/), e.g. after the record "
                   "gained an outcome; the previous file is kept as records.jsonl.before-rerecord")
    args = p.parse_args(argv)
    bad = [o for o in args.outcomes if o not in S.END_OUTCOMES]
    if bad:  # checked before any run: a typo must not cost the whole grid
        p.error(f"--outcomes: unknown {bad}; known: {', '.join(S.END_OUTCOMES)}")
    if args.rerecord and not args.report_only:
        p.error("--rerecord goes with --report-only (it rebuilds records, it runs nothing)")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.primary is not None and args.primary not in args.outcomes:
        p.error(f"--primary {args.primary!r} is not among --outcomes {args.outcomes}")
    smoke = args.smoke
    args.methods = args.methods or (G.SMOKE_METHODS if smoke else list(G.METHODS))
    args.settings = args.settings or (G.SMOKE_SETTINGS if smoke else G.DEFAULT_SETTINGS)
    args.seeds = args.seeds or ([1, 2] if smoke else [1, 2, 3])
    sizes = (G.SMOKE_SIZES if args.smoke else G.SIZES) + args.overrides
    grid = G.Grid(args.methods, args.settings, args.seeds, sizes=sizes)
    warmup = G.SMOKE_WARMUP if args.smoke else []
    if args.report_only:
        if args.rerecord:
            print(f"stability: {run.rerecord(args.output_dir)} records rebuilt from their runs")
        records = run.read_records(args.output_dir)
    else:
        records = run.run_grid(grid, config=args.config, out=args.output_dir,
                               warmup_overrides=warmup, nproc=args.nproc, threads=args.threads,
                               jobs=args.jobs or run.default_jobs(args.nproc, args.threads))
    records = run.in_grid_order(grid, records)
    command = "megatron-pdm-stability " + shlex.join(argv if argv is not None else sys.argv[1:])
    report.write(args.output_dir, records, command=command, baseline=args.baseline,
                 outcomes=args.outcomes, primary=args.primary,
                 grid={"methods": args.methods, "settings": args.settings, "seeds": args.seeds,
                       "sizes": sizes, "warmup": warmup, "config": args.config},
                 resamples=2000 if args.smoke else 20000)
    print(open(os.path.join(args.output_dir, "results.md")).read(), flush=True)
    return 0


def cli() -> None:
    from megatron_pdm.cli import run_cli

    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
