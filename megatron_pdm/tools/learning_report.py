"""The held-out gain of several seeds' RL runs, pooled by problem (docs/real-model.md).

    megatron-pdm-learning-report runs/real_learn/seed1 runs/real_learn/seed2 ... --out DIR

reads each run's eval.jsonl, metrics.jsonl and summary.json and writes DIR/results.json,
DIR/results.md and DIR/curves.png. The library is megatron_pdm/analysis/learning.py (the pooling
rule is its docstring); this file only parses the flags.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="megatron-pdm-learning-report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (output_dir of each seed's run)")
    p.add_argument("--out", required=True, help="directory of results.{json,md} and curves.png")
    p.add_argument("--start", default="before_rl", help="the evaluation the gain starts from")
    p.add_argument("--end", default="after_rl", help="the evaluation the gain ends at")
    p.add_argument("--bootstrap-seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_pdm.analysis import learning

    try:
        result = learning.learning_report(args.runs, args.out, start=args.start, end=args.end,
                                          seed=args.bootstrap_seed, plot_png=not args.no_plot)
    except (FileNotFoundError, ValueError) as e:
        print(f"megatron-pdm-learning-report: {e}", file=sys.stderr)
        return 2
    print(learning.markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
