"""Convert an HF Qwen3-MoE, dense Qwen3 or Llama checkpoint into a megatron-core dist checkpoint at a TP/EP/PP layout.

    megatron-pdm-convert-hf-to-megatron --hf-dir HF --out MCORE --tp 2 --ep 2 [--pp 1]
    (= python -m megatron_pdm.tools.convert_hf_to_megatron ...)

Run as one process: it spawns the pp*lcm(tp, ep) gloo ranks the layout needs (CPU, one thread
each). For large layouts spread over hosts, start it under torchrun with that many ranks instead
(`torchrun --nnodes N --nproc-per-node M -m megatron_pdm.tools.convert_hf_to_megatron ...`);
every rank reads only its own tensors. The checkpoint loads at any other layout with the same
vocab padding.

MCORE is Megatron-LM's `--load` layout (megatron_pdm/convert/load_dir.py): the dist checkpoint
in MCORE/release/ and the tracker MCORE/latest_checkpointed_iteration.txt ("release"), so
Megatron-LM and slime load it with `--load MCORE`; `pdm_model.json` beside them records the
architecture for export and training (`checkpoint.load_dir: MCORE`).
"""

from __future__ import annotations

import argparse
import sys
import time


def convert_hf_to_megatron(
    hf_dir: str,
    out: str,
    *,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    dtype: str = "auto",
    key_style: str = "local",
) -> float:
    """Import `hf_dir` into `out`; returns the wall time in seconds."""
    from megatron_pdm.convert import mapping
    from megatron_pdm.convert.checkpoint import import_rank
    from megatron_pdm.convert.distributed import launch
    from megatron_pdm.convert.hf_io import HFReader, read_hf_config
    from megatron_pdm.layout import validate_layout
    from megatron_pdm.arch import ModelArch, min_world_size

    start = time.perf_counter()
    # refuse a bad checkpoint or layout here (headers only) before spawning any rank
    arch = ModelArch.from_hf_config(read_hf_config(hf_dir))
    mapping.check_hf_tensors(HFReader(hf_dir), arch)
    world = min_world_size(tp=tp, ep=ep, pp=pp)
    validate_layout(arch, world_size=world, tp=tp, pp=pp, ep=ep)
    launch(import_rank, world, hf_dir, out, tp, ep, pp, dtype, key_style)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--hf-dir", required=True, help="HF checkpoint dir (config.json + safetensors)"
    )
    parser.add_argument("--out", required=True,
                        help="output directory (Megatron-LM --load layout: release/ + tracker)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="stored parameter dtype (auto = the HF dtype)",
    )
    parser.add_argument(
        "--key-style",
        default="local",
        choices=["local", "te"],
        help="pre-MLP norm key of the model that will load it (te = TE spec)",
    )
    args = parser.parse_args(argv)
    try:
        seconds = convert_hf_to_megatron(
            args.hf_dir,
            args.out,
            tp=args.tp,
            ep=args.ep,
            pp=args.pp,
            dtype=args.dtype,
            key_style=args.key_style,
        )
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"convert_hf_to_megatron: {exc}")
    print(f"wrote {args.out} (TP={args.tp} EP={args.ep} PP={args.pp}) in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
