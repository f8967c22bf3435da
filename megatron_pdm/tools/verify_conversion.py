"""Compare an HF Qwen3-MoE model with its converted megatron-core checkpoint on the same prompts.

    megatron-pdm-verify-conversion --hf-dir HF --megatron-dir MCORE --tp 2 --ep 1 \
        [--num-prompts 4 --seq-len 32 --max-dlogit 1e-3 --max-kl 1e-6]
    (= python -m megatron_pdm.tools.verify_conversion ...)

The HF model runs with transformers (fp32 on CPU); the megatron checkpoint is loaded at the given
layout (any TP/EP with PP=1; the checkpoint may have been written at another layout) in
pp*lcm(tp, ep) spawned gloo ranks (or under torchrun), and its vocab-parallel logits are gathered
over TP and stripped of the vocab padding. Prompts are seeded random token ids. Reports
max |dlogit| and the mean / max per-token KL(p_hf || p_megatron) (torchtitan's check) and exits
non-zero when either is over its threshold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def verify_conversion(
    hf_dir: str,
    megatron_dir: str,
    *,
    tp: int = 1,
    ep: int = 1,
    num_prompts: int = 4,
    seq_len: int = 32,
    seed: int = 0,
) -> dict:
    """Max |dlogit| and KL between HF and megatron logits on seeded random prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_pdm.convert.checkpoint import megatron_logits_rank
    from megatron_pdm.arch import min_world_size
    from megatron_pdm.convert.distributed import launch

    if seq_len % tp:
        raise ValueError(f"seq_len={seq_len} must be divisible by TP={tp} (sequence parallel)")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    hf.eval()
    gen = torch.Generator().manual_seed(seed)
    ids_bs = torch.randint(0, hf.config.vocab_size, (num_prompts, seq_len), generator=gen)
    with torch.no_grad():
        hf_bsv = hf(input_ids=ids_bs).logits.double()
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = Path(tmp) / "ids.pt", Path(tmp) / "logits.pt"
        torch.save(ids_bs, ids_path)
        launch(
            megatron_logits_rank,
            min_world_size(tp=tp, ep=ep),
            megatron_dir,
            tp,
            ep,
            str(ids_path),
            str(out_path),
        )
        mc_bsv = torch.load(out_path).double()
    if mc_bsv.shape != hf_bsv.shape:
        raise ValueError(
            f"logit shapes differ: HF {tuple(hf_bsv.shape)}, megatron {tuple(mc_bsv.shape)}"
        )
    logp_hf, logp_mc = hf_bsv.log_softmax(-1), mc_bsv.log_softmax(-1)
    kl_bs = (logp_hf.exp() * (logp_hf - logp_mc)).sum(-1)
    return {
        "tp": tp,
        "ep": ep,
        "tokens": num_prompts * seq_len,
        "max_abs_dlogit": (hf_bsv - mc_bsv).abs().max().item(),
        "max_abs_logit": hf_bsv.abs().max().item(),
        "mean_kl": kl_bs.mean().item(),
        "max_kl": kl_bs.max().item(),
        "argmax_agreement": (hf_bsv.argmax(-1) == mc_bsv.argmax(-1)).double().mean().item(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--megatron-dir", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-dlogit",
        type=float,
        default=1e-3,
        help="fail above this max |dlogit| (fp32 conversions reach ~1e-5)",
    )
    parser.add_argument("--max-kl", type=float, default=1e-6, help="fail above this max KL")
    args = parser.parse_args(argv)
    result = verify_conversion(
        args.hf_dir,
        args.megatron_dir,
        tp=args.tp,
        ep=args.ep,
        num_prompts=args.num_prompts,
        seq_len=args.seq_len,
        seed=args.seed,
    )
    print(json.dumps(result, indent=2))
    bad = result["max_abs_dlogit"] > args.max_dlogit or result["max_kl"] > args.max_kl
    if bad:
        sys.exit(
            f"verify_conversion: FAILED (max |dlogit| {result['max_abs_dlogit']:.3g} > "
            f"{args.max_dlogit:g} or max KL {result['max_kl']:.3g} > {args.max_kl:g})"
        )
    print("verify_conversion: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
