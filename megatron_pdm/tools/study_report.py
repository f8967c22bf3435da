"""Stored results and the docs' generated blocks (megatron_pdm/analysis/doc_blocks.py).

    megatron-pdm-study-report --store runs/masks/results.json --out results/mask_study/NAME
        a small copy of a study's results.json for the repository (setup + per-seed counts)
    megatron-pdm-study-report --store-run runs/tiny_cpu --out results/main_job/NAME \\
        --command "make demo SEED=1 THREADS=1" [--note "load 2-4"]
        a `make demo` run's summary.json and a run.json (command, commit, date) for the repository
    megatron-pdm-study-report --update-doc README.md docs/mask-study.md docs/main-job.md \
        docs/stability.md
        rewrites every generated block of the docs (`<!-- KIND PATH -->` ... `<!-- /KIND -->`)
        from the committed file PATH names (`make results-docs`)
    megatron-pdm-study-report --check DOC ...
        exit status 1 when a block differs from what --update-doc would write

The libraries are megatron_pdm/analysis/stored.py, main_job.py and doc_blocks.py, and
megatron_pdm/stability/doc.py for the stability blocks (KINDS below: both sets of block kinds);
this file only parses the flags.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="megatron-pdm-study-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--store", metavar="RESULTS_JSON", help="a study's results.json to store")
    what.add_argument("--store-run", metavar="RUN_DIR", help="a driver run's output directory "
                                                             "to store (its summary.json)")
    what.add_argument("--update-doc", metavar="DOC", nargs="+",
                      help="the docs whose generated blocks to rewrite")
    what.add_argument("--check", metavar="DOC", nargs="+", help="the docs whose blocks to compare")
    p.add_argument("--out", help="--store / --store-run: the directory of the stored copy "
                                 "(results/mask_study/<name>, results/main_job/<name>)")
    p.add_argument("--command", help="--store-run: the command that made the run")
    p.add_argument("--note", default="", help="--store-run: conditions (load, what ran beside)")
    p.add_argument("--commit", default=None, help="--store-run: the commit the run ran (default: "
                                                  "HEAD of the checkout)")
    p.add_argument("--root", default=".", help="the directory the blocks' paths are relative to")
    return p.parse_args(argv)


def kinds() -> dict:
    """Every generated block kind: the analysis ones (doc_blocks.KINDS) and the stability grid's
    (megatron_pdm/stability/doc.py), registered here, where both layers may be imported."""
    from megatron_pdm.analysis import doc_blocks
    from megatron_pdm.stability import doc as stability_doc

    return {**doc_blocks.KINDS, **stability_doc.KINDS}


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_pdm.analysis import doc_blocks, main_job, stored

    if args.store or args.store_run:
        if not args.out:
            raise SystemExit("megatron-pdm-study-report: --store / --store-run need --out DIR")
        if args.store:
            print(stored.store(args.store, args.out))
            return 0
        if not args.command:
            raise SystemExit("megatron-pdm-study-report: --store-run needs --command (how the "
                             "run was made)")
        print(main_job.store(args.store_run, args.out, args.command, args.note, args.commit))
        return 0
    if args.update_doc:
        for doc in args.update_doc:
            n = doc_blocks.update(doc, args.root, kinds())
            print(f"{doc}: {n} block(s) regenerated")
        return 0
    status = 0
    for doc in args.check:
        for block in doc_blocks.check(doc, args.root, kinds()):
            print(f"{doc}: the block `{block}` differs from what --update-doc generates")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
