"""Convert a megatron-core dist checkpoint (written by convert_hf_to_megatron) to HF safetensors.

    megatron-pdm-convert-megatron-to-hf --megatron-dir MCORE --out HF [--max-shard-size 5GB]
    (= python -m megatron_pdm.tools.convert_megatron_to_hf ...)

Works for a checkpoint saved at any TP/EP/PP: it reads one layer's global tensors at a time
straight from the torch_dist files (one process, no model is built), strips the vocab padding,
writes size-capped shards with model.safetensors.index.json, config.json and the tokenizer files.
"""

from __future__ import annotations

import argparse
import sys
import time


def convert_megatron_to_hf(
    megatron_dir: str,
    out: str,
    *,
    expert_layout: str = "source",
    dtype: str = "source",
    max_shard_size: str = "5GB",
) -> dict:
    """Export `megatron_dir` to `out`; returns a summary (files, tensors, bytes, seconds)."""
    from megatron_pdm.convert.export import export_to_hf
    from megatron_pdm.convert.hf_io import parse_size

    start = time.perf_counter()
    summary = export_to_hf(
        megatron_dir,
        out,
        expert_layout=expert_layout,
        dtype=dtype,
        max_shard_bytes=parse_size(max_shard_size),
    )
    summary["seconds"] = time.perf_counter() - start
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron-dir", required=True, help="dist checkpoint dir")
    parser.add_argument("--out", required=True, help="output HF checkpoint dir")
    parser.add_argument(
        "--expert-layout",
        default="source",
        choices=["source", "fused", "per_expert"],
        help="HF expert tensors: as imported, fused [E,2I,H] or per expert",
    )
    parser.add_argument("--dtype", default="source", choices=["source", "fp32", "bf16", "fp16"])
    parser.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
    args = parser.parse_args(argv)
    try:
        s = convert_megatron_to_hf(
            args.megatron_dir,
            args.out,
            expert_layout=args.expert_layout,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
        )
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"convert_megatron_to_hf: {exc}")
    print(
        f"wrote {args.out}: {s['tensors']} tensors, {len(s['files'])} file(s), "
        f"{s['bytes'] / 1e6:.1f} MB, {s['expert_layout']} experts, {s['dtype']}, "
        f"{s['seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
