"""Compare an HF model (Qwen3-MoE, dense Qwen3, Llama) with its converted megatron-core checkpoint.

    megatron-pdm-verify-conversion --hf-dir HF --megatron-dir MCORE --tp 2 --ep 1 \
        [--num-prompts 4 --seq-len 32 --max-dlogit 1e-3 --max-kl 1e-6]
    megatron-pdm-verify-conversion --hf-dir HF --megatron-dir MCORE --tp 3 --text [--chat] \
        [--prompts "first prompt" "second prompt" ...]
    (= python -m megatron_pdm.tools.verify_conversion ...)

The HF model runs with transformers (fp32 on CPU); the megatron checkpoint is loaded at the given
layout (any TP/EP with PP=1; the checkpoint may have been written at another layout) in
pp*lcm(tp, ep) spawned gloo ranks (or under torchrun, where rank 0 reports), and its
vocab-parallel logits are gathered over TP and stripped of the vocab padding. Prompts are seeded
random token ids, or with `--text` real text through the HF directory's own tokenizer
(`--prompts`, default `DEFAULT_PROMPTS`; `--chat` wraps each in the tokenizer's chat template
as a user turn): the prompts are right-padded to a common length that TP divides and only their
own tokens are compared. Reports
max |dlogit| and the mean / max per-token KL(p_hf || p_megatron) (torchtitan's check) and exits
non-zero when either is over its threshold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from megatron_pdm.intmath import round_up

DEFAULT_PROMPTS = (
    "What is 7 plus 5? Answer with a number.",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
)


def tokenize_prompts(hf_dir: str, prompts, *, chat: bool, multiple: int):
    """Token ids [B, S] of `prompts` (right-padded; S a multiple of `multiple`) and the bool mask
    [B, S] of real tokens, through the tokenizer of `hf_dir`."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    rows = []
    for i, text in enumerate(prompts):
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                          add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tok(text)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {i} ({text!r}) has no tokens")
        rows.append(list(ids))
    seq = round_up(max(len(r) for r in rows), multiple)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids_bs = torch.full((len(rows), seq), pad, dtype=torch.long)
    mask_bs = torch.zeros((len(rows), seq), dtype=torch.bool)
    for b, r in enumerate(rows):
        ids_bs[b, : len(r)] = torch.tensor(r)
        mask_bs[b, : len(r)] = True
    return ids_bs, mask_bs


def verify_conversion(
    hf_dir: str,
    megatron_dir: str,
    *,
    tp: int = 1,
    ep: int = 1,
    num_prompts: int = 4,
    seq_len: int = 32,
    seed: int = 0,
    prompts=None,
    chat: bool = False,
) -> dict:
    """Max |dlogit| and KL between HF and megatron logits on seeded random prompts, or on
    `prompts` (texts) through the HF directory's tokenizer (`chat`: as chat-template user turns).

    Under torchrun, or called on every rank of a formed process group, each rank runs its part of
    the megatron forward and only rank 0 (the one that holds the gathered logits) compares and
    returns the result; the other ranks return None.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_pdm.convert.checkpoint import megatron_logits_rank
    from megatron_pdm.arch import min_world_size
    from megatron_pdm.convert.distributed import launch, launch_rank

    if prompts is None and seq_len % tp:
        raise ValueError(f"seq_len={seq_len} must be divisible by TP={tp} (sequence parallel)")
    if prompts is None:  # the same seeded ids on every rank
        vocab = AutoConfig.from_pretrained(hf_dir, local_files_only=True).vocab_size
        gen = torch.Generator().manual_seed(seed)
        ids_bs = torch.randint(0, vocab, (num_prompts, seq_len), generator=gen)
        mask_bs = torch.ones_like(ids_bs, dtype=torch.bool)
    else:  # TP divides the length: megatron's sequence parallelism splits the sequence
        ids_bs, mask_bs = tokenize_prompts(hf_dir, prompts, chat=chat, multiple=tp)
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
        if launch_rank() != 0:  # rank 0 wrote the gathered logits, into its own folder
            return None
        mc_bsv = torch.load(out_path).double()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    hf.eval()
    with torch.no_grad():
        hf_bsv = hf(input_ids=ids_bs).logits.double()
    if mc_bsv.shape != hf_bsv.shape:
        raise ValueError(
            f"logit shapes differ: HF {tuple(hf_bsv.shape)}, megatron {tuple(mc_bsv.shape)}"
        )
    # right padding: causal attention keeps the real tokens' logits independent of it
    hf_tv, mc_tv = hf_bsv[mask_bs], mc_bsv[mask_bs]
    logp_hf, logp_mc = hf_tv.log_softmax(-1), mc_tv.log_softmax(-1)
    kl_t = (logp_hf.exp() * (logp_hf - logp_mc)).sum(-1)
    return {
        "tp": tp,
        "ep": ep,
        "prompts": "random ids" if prompts is None else "text" + (" (chat)" if chat else ""),
        "tokens": int(mask_bs.sum()),
        "max_abs_dlogit": (hf_tv - mc_tv).abs().max().item(),
        "max_abs_logit": hf_tv.abs().max().item(),
        "mean_kl": kl_t.mean().item(),
        "max_kl": kl_t.max().item(),
        "argmax_agreement": (hf_tv.argmax(-1) == mc_tv.argmax(-1)).double().mean().item(),
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
    parser.add_argument("--text", action="store_true",
                        help="real text through the HF dir's tokenizer instead of random ids")
    parser.add_argument("--prompts", nargs="+", default=None,
                        help="texts for --text (default: a few built-in prompts)")
    parser.add_argument("--chat", action="store_true",
                        help="with --text: each prompt as a chat-template user turn")
    parser.add_argument(
        "--max-dlogit",
        type=float,
        default=1e-3,
        help="fail above this max |dlogit| (fp32 conversions reach ~1e-5)",
    )
    parser.add_argument("--max-kl", type=float, default=1e-6, help="fail above this max KL")
    args = parser.parse_args(argv)
    if (args.prompts or args.chat) and not args.text:
        parser.error("--prompts / --chat need --text")
    result = verify_conversion(
        args.hf_dir,
        args.megatron_dir,
        tp=args.tp,
        ep=args.ep,
        num_prompts=args.num_prompts,
        seq_len=args.seq_len,
        seed=args.seed,
        prompts=(args.prompts or list(DEFAULT_PROMPTS)) if args.text else None,
        chat=args.chat,
    )
    if result is None:  # not rank 0 of a torchrun job: rank 0 reports
        return 0
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
