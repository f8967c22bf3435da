"""Write the tiny random HF Qwen3-MoE of the conversion example in docs/conversion.md (no download).

    megatron-pdm-make-tiny-hf --out ckpt/tiny_hf [--seed 0] [--expert-layout per_expert|fused]
    (= python -m megatron_pdm.tools.make_tiny_hf ...)

vocab 1000, hidden 64, 2 layers, 8 experts top-2 (megatron_pdm/convert/tiny.py); ~1 MB, a few
seconds. Then: megatron-pdm-convert-hf-to-megatron --hf-dir ckpt/tiny_hf --out ckpt/tiny_mcore ...
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    from megatron_pdm.convert.tiny import EXPERT_LAYOUTS, make_tiny_hf

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory (config.json + safetensors)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--expert-layout", default="per_expert", choices=EXPERT_LAYOUTS,
                   help="per_expert (hub/SGLang layout) or fused (gate_up_proj [E, 2I, H])")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = make_tiny_hf(args.out, seed=args.seed, expert_layout=args.expert_layout)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {args.out}: tiny random Qwen3-MoE, {n / 1e6:.2f} M parameters, "
          f"{args.expert_layout} experts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
