"""The mask study's stored results and the docs tables generated from them.

    megatron-pdm-study-report --store runs/masks/results.json --out results/mask_study/NAME
        a small copy of a study's results.json for the repository (setup + per-seed counts)
    megatron-pdm-study-report --update-doc docs/mask-study.md
        rewrites every `<!-- study-table PATH -->` ... `<!-- /study-table -->` block of the doc
        from the stored file PATH (the summary recomputed from its per-seed counts)
    megatron-pdm-study-report --check docs/mask-study.md
        exit status 1 when a block differs from what --update-doc would write

The library is megatron_pdm/analysis/stored.py; this file only parses the flags.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="megatron-pdm-study-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--store", metavar="RESULTS_JSON", help="a study's results.json to store")
    what.add_argument("--update-doc", metavar="DOC", help="the doc whose blocks to rewrite")
    what.add_argument("--check", metavar="DOC", help="the doc whose blocks to compare")
    p.add_argument("--out", help="--store: the directory of the stored copy "
                                 "(results/mask_study/<name>)")
    p.add_argument("--root", default=".", help="the directory the blocks' paths are relative to")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_pdm.analysis import stored

    if args.store:
        if not args.out:
            raise SystemExit("megatron-pdm-study-report: --store needs --out DIR")
        print(stored.store(args.store, args.out))
        return 0
    if args.update_doc:
        n = stored.update_doc(args.update_doc, args.root)
        print(f"{args.update_doc}: {n} block(s) regenerated")
        return 0
    bad = stored.check_doc(args.check, args.root)
    for path in bad:
        print(f"{args.check}: the block of {path} differs from what --update-doc generates")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
