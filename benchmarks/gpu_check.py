"""One prepared GPU check for Qwen3-30B-A3B scale: FP8 slice, TP correctness, op benchmark.

    python benchmarks/gpu_check.py --out gpu_check.json                 # parts 1 and 3, 1 GPU
    torchrun --nproc-per-node 2 benchmarks/gpu_check.py --tp-check      # part 2, 2 GPUs (NCCL)

1. fp8_slice: megatron GPTModel with the Transformer Engine spec (grouped-GEMM experts) at the
   real width of Qwen3-30B-A3B (hidden 2048, 32 heads / 4 groups, head dim 128, 128 experts
   top-8, expert FFN 768, vocab 151936) but `--layers` layers, run under an FP8 recipe
   (`--fp8-recipe delayed|blockwise`, e4m3): forward, PDM loss (`token_stats` + `policy_loss`,
   preset pdm-agg) on its logits against a synthetic rollout support, backward; reports time,
   peak memory and that loss and gradients are finite.
2. tp_check: `token_stats` on a TP=2 vocab shard (NCCL) against the single-device full-vocab
   result on the same logits: every statistic and the logits gradient. Also runs on CPU/gloo
   (tests/gpu/test_gpu_check.py uses that with a small vocabulary).
3. op_bench: `token_stats` + `policy_loss` forward+backward vs megatron's
   `vocab_parallel_cross_entropy` on [tokens, 151936] logits (TP=1), median of `--iters`.

Not run in CI (no GPU); numbers go to examples/qwen3_30b_a3b/README.md ("GPU check") only once measured on a device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron_pdm as pdm  # noqa: E402

V_QWEN3 = 151936


def synthetic_rollout(logits_nv: torch.Tensor, top_k: int, vocab_size: int, seed: int = 0):
    """Support = behavior top-K of perturbed logits with the sampled token folded in at slot 0."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = logits_nv.shape[0]
    noise = torch.randn(logits_nv.shape, generator=gen).to(logits_nv.device)
    behavior = (logits_nv.detach().float() + 0.1 * noise)[:, :vocab_size].log_softmax(-1)
    # Gumbel-max sampling from the seeded CPU generator: identical on every rank
    uniform = torch.rand(behavior.shape, generator=gen).clamp_min(1e-20).to(behavior.device)
    sampled_n = (behavior - (-uniform.log()).log()).argmax(-1)
    top_nk = behavior.topk(top_k, dim=-1).indices
    support = torch.cat([sampled_n[:, None], top_nk], dim=1)
    dup = top_nk == sampled_n[:, None]
    valid = torch.cat([torch.ones(n, 1, dtype=torch.bool, device=support.device), ~dup], dim=1)
    support_lp = behavior.gather(1, support)
    adv_n = torch.randn(n, generator=gen).to(logits_nv.device)
    return dict(
        sampled_ids=sampled_n,
        support_ids=support,
        support_logprobs=support_lp,
        support_valid=valid,
        advantages=adv_n,
        behavior_logprob=support_lp[:, 0].clone(),
        loss_mask=torch.ones(n, dtype=torch.bool, device=support.device),
    )


def pdm_loss(logits_nv, batch, *, tp_group, vocab_size):
    stats = pdm.token_stats(
        logits_nv,
        batch["sampled_ids"],
        batch["support_ids"],
        batch["support_logprobs"],
        batch["support_valid"],
        tp_group=tp_group,
        vocab_size=vocab_size,
    )
    out = pdm.policy_loss(
        stats,
        batch["advantages"],
        batch["behavior_logprob"],
        batch["loss_mask"],
        pdm.PolicyLossConfig.preset("pdm-agg"),
    )
    return stats, out


def fp8_slice(layers: int, seq_len: int, recipe: str) -> dict:
    """Reduced-depth Qwen3-30B-A3B under TE FP8: forward, PDM loss, backward (one GPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_pdm.arch import Qwen3MoeArch
    from megatron_pdm.mcore.model import build_model, transformer_config

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    arch = Qwen3MoeArch.qwen3_30b_a3b()
    arch.num_layers = layers
    config = transformer_config(
        arch,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=False,
        fp8="e4m3",
        fp8_recipe=recipe,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall",
    )
    model = build_model(arch, config, use_te=True).cuda()
    ids = torch.randint(0, arch.vocab_size, (1, seq_len), device="cuda")
    pos = torch.arange(seq_len, device="cuda")[None]
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    logits_bsv = model(ids, pos, None)
    logits_nv = logits_bsv.reshape(seq_len, -1)
    batch = synthetic_rollout(logits_nv, top_k=20, vocab_size=arch.vocab_size)
    _, out = pdm_loss(logits_nv, batch, tp_group=None, vocab_size=arch.vocab_size)
    loss_sum, num_tokens, _ = out
    (loss_sum / num_tokens).backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads_finite = all(
        torch.isfinite(
            p.main_grad if hasattr(p, "main_grad") and p.main_grad is not None else p.grad
        )
        .all()
        .item()
        for p in model.parameters()
        if p.grad is not None
    )
    ps.destroy_model_parallel()
    return {
        "layers": layers,
        "seq_len": seq_len,
        "fp8_recipe": recipe,
        "loss": (loss_sum / num_tokens).item(),
        "loss_finite": bool(torch.isfinite(loss_sum)),
        "grads_finite": grads_finite,
        "fwd_bwd_s": seconds,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def tp_check(vocab: int, tokens: int, device: str) -> dict:
    """token_stats on this rank's vocab shard vs the full-vocab single-device reference.

    Call on every rank of a 2-rank group; returns max abs differences (rank 0 meaningful).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    v_pad = -(-vocab // (128 * world)) * 128 * world
    full_nv = (3 * torch.randn(tokens, v_pad, generator=gen)).to(device)
    batch = synthetic_rollout(full_nv, top_k=8, vocab_size=vocab)
    ref_logits = full_nv.clone().requires_grad_(True)
    ref_stats, ref_out = pdm_loss(ref_logits, batch, tp_group=None, vocab_size=vocab)
    ref_out[0].backward()
    v_local = v_pad // world
    shard = full_nv[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_(True)
    stats, out = pdm_loss(shard, batch, vocab_size=vocab, tp_group=dist.group.WORLD)
    out[0].backward()
    diffs = {
        "loss": (out[0] - ref_out[0]).abs().item(),
        "grad": (shard.grad - ref_logits.grad[:, rank * v_local : (rank + 1) * v_local])
        .abs()
        .max()
        .item(),
    }
    for name, value in vars(stats).items():
        ref = getattr(ref_stats, name)
        if torch.is_tensor(value) and value.is_floating_point():
            finite = torch.isfinite(ref)
            if not torch.equal(finite, torch.isfinite(value)):
                diffs[name] = float("inf")
            else:
                diffs[name] = (
                    (value[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
                )
    worst = torch.tensor([max(diffs.values())], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {
        "world": world,
        "vocab": vocab,
        "tokens": tokens,
        "max_abs_diff": diffs,
        "worst": worst.item(),
    }


def op_bench(tokens: int, iters: int) -> dict:
    """PDM op vs megatron vocab_parallel_cross_entropy at V=151936, fwd+bwd, TP=1."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if not ps.model_parallel_is_initialized():
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29518")
            dist.init_process_group("nccl", rank=0, world_size=1)
        ps.initialize_model_parallel(1, 1)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(tokens, V_QWEN3, generator=gen)).to("cuda", torch.bfloat16)
    batch = synthetic_rollout(logits, top_k=20, vocab_size=V_QWEN3)

    def run_pdm():
        x = logits.detach().requires_grad_(True)
        _, out = pdm_loss(x, batch, tp_group=None, vocab_size=V_QWEN3)
        out[0].backward()

    def run_ce():
        x = logits.detach().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x.float()[:, None], batch["sampled_ids"][:, None])
        loss.sum().backward()

    result = {"tokens": tokens, "vocab": V_QWEN3, "dtype": "bf16"}
    for name, fn in (("pdm_fwd_bwd_ms", run_pdm), ("megatron_ce_fwd_bwd_ms", run_ce)):
        fn()  # warm-up
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        result[name] = sorted(times)[len(times) // 2]
    result["ratio_pdm_over_ce"] = result["pdm_fwd_bwd_ms"] / result["megatron_ce_fwd_bwd_ms"]
    return result


def gpu_check(
    out: str, *, layers: int, seq_len: int, recipe: str, tokens: int, iters: int, tp_only: bool
) -> dict:
    """Run the parts this launch supports and write them as json to `out` (rank 0)."""
    results: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    }
    if tp_only:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        device = "cpu"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = "cuda"
        results["tp_check"] = tp_check(V_QWEN3, 256, device)
        if dist.get_rank() != 0:
            return results
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (parts 1 and 3 need one GPU)")
        results["fp8_slice"] = fp8_slice(layers, seq_len, recipe)
        results["op_bench"] = op_bench(tokens, iters)
    Path(out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--layers", type=int, default=2, help="depth of the Qwen3-30B-A3B slice")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--fp8-recipe", default="blockwise", choices=["blockwise", "delayed"])
    parser.add_argument("--tokens", type=int, default=4096, help="op benchmark rows")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tp-check", action="store_true", help="part 2 only (under torchrun)")
    args = parser.parse_args()
    res = gpu_check(
        args.out,
        layers=args.layers,
        seq_len=args.seq_len,
        recipe=args.fp8_recipe,
        tokens=args.tokens,
        iters=args.iters,
        tp_only=args.tp_check,
    )
    print(json.dumps(res, indent=2))
