"""Parallel-layout validation and a per-GPU memory estimate, without allocating anything.

Pure python (no torch, no model): the training driver's `--dry-run` calls
`validate_layout` and `estimate_memory`, prints `format_report`, and exits before building the
model, so a bad layout for a 48-layer, 128-expert model is refused in a second on a login node.

Layout rules checked (megatron-core's, for a MoE GPT with expert tensor parallelism ETP):
- every size >= 1; world_size divisible by TP*PP*CP, DP = world_size / (TP*PP*CP);
- experts divisible by EP; attention heads and query groups divisible by TP; layers by PP;
- the expert grid fits the dense one: EP*ETP divides TP*CP*DP (expert-DP = TP*CP*DP/(EP*ETP));
  expert FFN width divisible by ETP;
- MoE with TP > 1 needs sequence parallelism (megatron raises otherwise during training).
The vocabulary padding (`ModelArch.padded_vocab`) is reported; the smallest world for a
layout is `arch.min_world_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_pdm.arch import ModelArch
from megatron_pdm.configtree import ConfigError

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    ep: int
    cp: int
    etp: int
    dp: int
    sequence_parallel: bool
    padded_vocab_size: int
    notes: tuple[str, ...] = field(default=())

    @property
    def expert_dp(self) -> int:
        return self.tp * self.cp * self.dp // (self.ep * self.etp)


def validate_layout(
    arch: ModelArch,
    *,
    world_size: int,
    tp: int,
    pp: int,
    ep: int,
    cp: int = 1,
    etp: int = 1,
    sequence_parallel: bool | None = None,
) -> Layout:
    """Check a layout for `arch` (a ModelArch or anything with its fields).

    Raises ConfigError listing every problem; returns the Layout (with DP derived) otherwise.
    """
    if sequence_parallel is None:
        sequence_parallel = tp > 1
    sizes = dict(world_size=world_size, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp)
    problems = [
        f"{k}={v} must be a positive integer"
        for k, v in sizes.items()
        if not isinstance(v, int) or v < 1
    ]
    if problems:
        raise ConfigError("invalid parallel layout:\n  " + "\n  ".join(problems))
    dp = world_size // (tp * pp * cp)
    if world_size % (tp * pp * cp):
        problems.append(f"world_size={world_size} is not divisible by TP*PP*CP={tp * pp * cp}")
        dp = 0
    if not arch.num_experts and (ep > 1 or etp > 1):
        problems.append(f"EP={ep} / ETP={etp}: a dense model (num_experts=0) has no experts to "
                        "split (use EP=1, ETP=1)")
    elif arch.num_experts % ep:
        problems.append(f"num_experts={arch.num_experts} is not divisible by EP={ep}")
    if arch.num_attention_heads % tp:
        problems.append(
            f"num_attention_heads={arch.num_attention_heads} is not divisible by TP={tp}"
        )
    if arch.num_query_groups % tp:
        problems.append(f"num_query_groups={arch.num_query_groups} is not divisible by TP={tp}")
    if arch.num_layers % pp:
        problems.append(f"num_layers={arch.num_layers} is not divisible by PP={pp}")
    if dp and (tp * cp * dp) % (ep * etp):
        problems.append(
            f"EP*ETP={ep * etp} does not divide TP*CP*DP={tp * cp * dp} "
            f"(expert ranks must tile the dense ranks of a pipeline stage)"
        )
    if arch.num_experts and arch.moe_ffn_hidden_size % etp:
        problems.append(
            f"moe_ffn_hidden_size={arch.moe_ffn_hidden_size} is not divisible by ETP={etp}"
        )
    if tp > 1 and not sequence_parallel:
        problems.append("MoE with TP > 1 requires sequence_parallel=True")
    if sequence_parallel and tp == 1:
        problems.append("sequence_parallel=True needs TP > 1")
    if problems:
        raise ConfigError("invalid parallel layout:\n  " + "\n  ".join(problems))
    vpad = arch.padded_vocab(tp)
    notes = (
        f"vocab {arch.vocab_size} padded to {vpad} (multiple of "
        f"{arch.make_vocab_size_divisible_by}*TP={arch.make_vocab_size_divisible_by * tp}; "
        f"{vpad - arch.vocab_size} padding rows, masked by the loss)",
    )
    return Layout(world_size, tp, pp, ep, cp, etp, dp, sequence_parallel, vpad, notes)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of the most loaded pipeline stage (see `estimate_memory` for formulas)."""

    dense_params: int
    expert_params: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits


def param_counts(arch, layout: Layout) -> tuple[int, int]:
    """(dense, expert) parameters held by one GPU of the most loaded stage."""
    h, d, e = arch.hidden_size, arch.head_dim, arch.num_experts
    nh, g, i = arch.num_attention_heads, arch.num_query_groups, arch.moe_ffn_hidden_size
    layers = arch.num_layers // layout.pp
    attn = ((nh + 2 * g) * d * h + h * nh * d) // layout.tp
    # input/pre-MLP norms, q/k norms, router; a dense model's MLP instead of the router
    replicated = 2 * h + (2 * d if arch.qk_layernorm else 0) + e * h
    mlp = 0 if e else 3 * arch.ffn_hidden_size * h // layout.tp
    vocab = layout.padded_vocab_size * h // layout.tp
    # PP=1: one stage holds embedding and output (one matrix if tied); PP>1: first/last stage
    # holds one of them
    embed = 2 * vocab if layout.pp == 1 and not arch.tie_word_embeddings else vocab
    dense = layers * (attn + replicated + mlp) + embed + h
    expert = layers * e * 3 * i * h // (layout.ep * layout.etp)
    return dense, expert


def estimate_memory(
    arch,
    layout: Layout,
    *,
    micro_batch_size: int,
    seq_length: int,
    params_dtype: str = "bf16",
    fp8: bool = False,
    distributed_optimizer: bool = True,
    recompute: str = "none",
    grads_fp32: bool = True,
    num_microbatches: int | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of training `arch` at `layout` (bytes), most loaded pipeline stage.

    Assumptions (megatron-core DDP + Adam, Korthikanti et al. 2022 activation accounting):
    - weights: params_dtype bytes per parameter; FP8 (TE) adds 1 byte per linear weight for the
      FP8 copy (norms/router/embeddings stay high precision);
    - grads: fp32 main grads (4 B/param) when `grads_fp32`, else params_dtype;
    - optimizer (Adam): fp32 master copy (when params are not fp32) + exp_avg + exp_avg_sq =
      12 B/param (8 with fp32 params); with the distributed optimizer dense params are sharded
      over DP*CP and expert params over expert-DP = TP*CP*DP/(EP*ETP);
    - activations per layer for T = micro_batch*seq/CP tokens, with SP everything divided by TP,
      bf16 (2 B), dropout 0, flash attention (no s^2 term), top-k routed copies of each token:
        T/TP * [4h (norm + qkv inputs) + 2(nh+2g)D (q,k,v) + 4 nh D (attention out + proj input)
                + 6h + 4E (pre-MLP norm, fp32 router input and logits)
                + k (4h + 6I) (fc1 input, fc1 out 2I, SwiGLU out I, fc2 out)]
      `recompute="full"` keeps only the 2h-byte layer input per layer plus one layer's
      activations; `"selective"` drops the attention-core term (4 nh D -> 2 nh D);
      1F1B keeps min(PP, num_microbatches) micro-batches in flight on the first stage;
    - logits: fp32 [T, V_pad/TP] plus one saved fp32 buffer of the same size (loss backward);
    - not included: CUDA context, NCCL and dispatcher buffers, allocator fragmentation (budget
      several GiB on top).
    """
    if params_dtype not in _BYTES:
        raise ValueError(f"params_dtype must be one of {sorted(_BYTES)}, got {params_dtype!r}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none|selective|full, got {recompute!r}")
    pbytes = _BYTES[params_dtype]
    dense, expert = param_counts(arch, layout)
    total_params = dense + expert
    weights = total_params * pbytes
    if fp8:
        h, vocab = arch.hidden_size, layout.padded_vocab_size * arch.hidden_size // layout.tp
        embed = 2 * vocab if layout.pp == 1 and not arch.tie_word_embeddings else vocab
        weights += (dense - embed - h) + expert  # 1-byte FP8 copy of the linear weights
    grads = total_params * (4 if grads_fp32 else pbytes)
    opt_per_param = 12 if pbytes != 4 else 8
    if distributed_optimizer:
        optimizer = (dense * opt_per_param) // (layout.dp * layout.cp)
        optimizer += (expert * opt_per_param) // layout.expert_dp
    else:
        optimizer = total_params * opt_per_param

    h, d, e = arch.hidden_size, arch.head_dim, arch.num_experts
    nh, g, i, k = (  # a dense model: one "expert" of the MLP width, no router
        arch.num_attention_heads,
        arch.num_query_groups,
        arch.moe_ffn_hidden_size if e else arch.ffn_hidden_size,
        arch.moe_router_topk if e else 1,
    )
    tokens = micro_batch_size * seq_length // layout.cp
    core = 2 * nh * d if recompute == "selective" else 4 * nh * d
    per_token = 4 * h + 2 * (nh + 2 * g) * d + core + 6 * h + 4 * e + k * (4 * h + 6 * i)
    per_layer = tokens * per_token // layout.tp
    layers = arch.num_layers // layout.pp
    in_flight = min(layout.pp, num_microbatches or layout.pp)
    if recompute == "full":
        stage = layers * tokens * 2 * h // layout.tp + per_layer
    else:
        stage = layers * per_layer
    activations = stage * in_flight
    logits = 2 * tokens * (layout.padded_vocab_size // layout.tp) * 4
    return MemoryEstimate(dense, expert, weights, grads, optimizer, activations, logits)


def format_report(
    arch, layout: Layout, estimate: MemoryEstimate, *, gpu_memory_gib: float | None = None
) -> str:
    """Human-readable dry-run report."""

    def gib(x: int) -> str:
        return f"{x / GIB:8.2f} GiB"

    lines = [
        f"layout: world={layout.world_size} TP={layout.tp} PP={layout.pp} CP={layout.cp} "
        f"EP={layout.ep} ETP={layout.etp} -> DP={layout.dp}, expert-DP={layout.expert_dp}, "
        f"sequence_parallel={layout.sequence_parallel}",
        f"model: {arch.num_layers} layers, hidden {arch.hidden_size}, "
        + (f"{arch.num_experts} experts top-{arch.moe_router_topk}" if arch.num_experts
           else f"dense MLP {arch.ffn_hidden_size}") + f", vocab {arch.vocab_size}",
        *[f"note: {n}" for n in layout.notes],
        f"params per GPU: dense {estimate.dense_params / 1e6:.1f} M, "
        f"expert {estimate.expert_params / 1e6:.1f} M",
        f"  weights      {gib(estimate.weights)}",
        f"  grads        {gib(estimate.grads)}",
        f"  optimizer    {gib(estimate.optimizer)}",
        f"  activations  {gib(estimate.activations)}",
        f"  logits       {gib(estimate.logits)}",
        f"  total        {gib(estimate.total)}  (+ CUDA context, NCCL buffers, fragmentation)",
    ]
    if gpu_memory_gib is not None:
        verdict = "fits" if estimate.total / GIB < gpu_memory_gib else "DOES NOT FIT"
        lines.append(f"  {verdict} in {gpu_memory_gib:.0f} GiB per GPU")
    return "\n".join(lines)
