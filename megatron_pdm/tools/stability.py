"""megatron-pdm-stability: the trust-region stability grid (docs/stability.md).

    megatron-pdm-stability --output-dir results/stability/full \
        [--methods ...] [--settings ...] [--seeds 1 2 3] [--smoke] [--set key=value]
        [--model tiny|real [--real-hf-dir DIR] [--real-mcore-dir DIR]]

Runs the shared warm-up once, then every (method, setting, seed) cell as its own driver run
(skipping cells already in records.jsonl), then writes results.json, results.md, curves.png.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from megatron_pdm.stability import grid as G
from megatron_pdm.stability import profiles, report, run
from megatron_pdm.stability import summary as S



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=None,
                   help=f"run config (default: the --model profile's, {profiles.tiny().config} for tiny, "
                        "relative to a source checkout's root; the wheel ships no examples: "
                        "pass your own)")
    p.add_argument("--model", default="tiny", choices=sorted(profiles.PROFILES),
                   help="the profile (megatron_pdm/stability/profiles.py): tiny (default; shared "
                        "warm-up, local engine) or real (SmolLM2-135M-Instruct, no warm-up, "
                        "one vLLM server per run: needs make real-model, the converted "
                        "checkpoint and make vllm-venv; docs/stability.md)")
    p.add_argument("--real-hf-dir", default=profiles.REAL_HF_DIR,
                   help="--model real: the HF directory (served by vLLM; the tokenizer)")
    p.add_argument("--real-mcore-dir", default=profiles.REAL_MCORE_DIR,
                   help="--model real: its converted checkpoint (checkpoint.load_dir)")
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
                        "count // (nproc x threads, plus 1 when each cell starts an engine "
                        "server: --model real, engine-vllm-bf16); a cell's numbers do not "
                        "depend on it)")
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
    extra = {} if args.model == "tiny" else {"hf_dir": args.real_hf_dir,
                                             "mcore_dir": args.real_mcore_dir,
                                             "check": not args.report_only}
    try:
        prof = profiles.get(args.model, **extra)
    except ValueError as err:
        p.error(str(err))
    args.config = args.config or prof.config
    sizes = (prof.smoke_sizes if args.smoke else prof.sizes) + args.overrides
    grid = G.Grid(args.methods, args.settings, args.seeds, sizes=sizes, server=prof.server)
    warmup = prof.smoke_warmup if args.smoke else prof.warmup
    if args.report_only:
        if args.rerecord:
            print(f"stability: {run.rerecord(args.output_dir)} records rebuilt from their runs")
        records = run.read_records(args.output_dir)
    else:
        records = run.run_grid(grid, config=args.config, out=args.output_dir,
                               warmup_overrides=warmup, nproc=args.nproc, threads=args.threads,
                               jobs=args.jobs or run.default_jobs(
                                   args.nproc, args.threads, server=bool(prof.server) or any(
                                       s in G.SERVER_SETTINGS for s in args.settings)))
    records = run.in_grid_order(grid, records)
    command = "megatron-pdm-stability " + shlex.join(argv if argv is not None else sys.argv[1:])
    report.write(args.output_dir, records, command=command, baseline=args.baseline,
                 outcomes=args.outcomes, primary=args.primary,
                 grid={"methods": args.methods, "settings": args.settings, "seeds": args.seeds,
                       "sizes": sizes, "warmup": warmup, "config": args.config,
                       "model": args.model, "server": prof.server},
                 resamples=2000 if args.smoke else 20000)
    print(open(os.path.join(args.output_dir, "results.md")).read(), flush=True)
    return 0


def cli() -> None:
    from megatron_pdm.cli import run_cli

    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
