"""Weight names and shapes of the `arch.ModelArch` families (Qwen3-MoE, dense Qwen3, Llama):
Hugging Face <-> megatron-core (pure torch, no megatron).

Both sides are described as *full* (unsharded) tensors. The megatron side uses "canonical
names": the state-dict names of a TP=1, EP=1, PP=1 megatron GPTModel built with the local spec
(sequential experts), with global layer and global expert indices::

    embedding.word_embeddings.weight                        [V_pad, H]   <- model.embed_tokens
    output_layer.weight                                     [V_pad, H]   <- lm_head (untied)
    decoder.final_layernorm.weight                          [H]          <- model.norm
    decoder.layers.L.input_layernorm.weight                 [H]          <- input_layernorm
    decoder.layers.L.self_attention.linear_qkv.weight       [(nh+2g)D, H] <- q/k/v_proj (fused)
    decoder.layers.L.self_attention.linear_proj.weight      [H, nh*D]    <- o_proj
    decoder.layers.L.self_attention.{q,k}_layernorm.weight  [D]          <- {q,k}_norm
    decoder.layers.L.pre_mlp_layernorm.weight               [H]          <- post_attention_layernorm
    decoder.layers.L.mlp.router.weight                      [E, H]       <- mlp.gate
    decoder.layers.L.mlp.experts.local_experts.e.linear_fc1.weight [2I, H] <- [gate; up] of expert e
    decoder.layers.L.mlp.experts.local_experts.e.linear_fc2.weight [H, I]  <- down of expert e

Dense families (num_experts = 0) have no router and experts but one MLP per layer, and Llama has
no q/k norms::

    decoder.layers.L.mlp.linear_fc1.weight                  [2F, H]      <- [mlp.gate_proj; up_proj]
    decoder.layers.L.mlp.linear_fc2.weight                  [H, F]       <- mlp.down_proj

Tied embeddings (`tie_word_embeddings`): HF holds no lm_head and megatron no output_layer (its
output layer reads the embedding; under PP the last stage's copy of it is filled from
model.embed_tokens), so neither name exists on either side.

Why each transform:
- QKV: megatron's fused projection is interleaved per query group: for group g the rows are
  [q heads of g (nh/g * D rows), k_g (D rows), v_g (D rows)]. This keeps a TP shard (a contiguous
  block of groups) self-contained.
- SwiGLU: megatron's linear_fc1 holds [gate; up] and applies silu to the first half.
- Vocabulary: megatron pads the embedding and output rows to a multiple of
  `make_vocab_size_divisible_by * TP`; padding rows are zero on import and stripped on export.
- HF experts come in two layouts. transformers 5.x stores them fused
  (`mlp.experts.gate_up_proj [E, 2I, H]` with gate first, `mlp.experts.down_proj [E, H, I]`);
  hub checkpoints (and SGLang) use per-expert `mlp.experts.e.{gate,up,down}_proj.weight`.
  Both are read; either can be written. A dense model has no experts: its layout is moot.

Megatron's grouped-GEMM expert layouts are converted from and to the sequential one in
`expert_layouts.py`; the name patterns of both sides are in `names.py`.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

from megatron_pdm.convert import names
from megatron_pdm.convert.hf_io import HFReader

# canonical per-layer suffix -> HF per-layer suffix for the one-to-one tensors (all families;
# `_layer_direct` keeps the ones an architecture has)
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
DENSE_FC1 = "mlp.linear_fc1.weight"  # canonical suffix of a dense layer's [gate; up]
EXPERT_LAYOUTS = ("fused", "per_expert")


def _layer_direct(arch) -> dict[str, str]:
    """The one-to-one per-layer tensors of `arch` (q/k norms, router / dense fc2 by family)."""
    drop = set() if arch.qk_layernorm else set(_QK_NORMS)
    drop.add("mlp.linear_fc2.weight" if arch.is_moe else "mlp.router.weight")
    return {k: v for k, v in _LAYER_DIRECT.items() if k not in drop}


def hf_output_name(arch) -> str:
    """The HF tensor megatron's output layer is read from: lm_head, or the embedding if tied."""
    return "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------


def hf_shapes(arch, expert_layout: str) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of `arch` must hold, with its shape."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    H, D, E, I = arch.hidden_size, arch.head_dim, arch.num_experts, arch.moe_ffn_hidden_size
    nh, g = arch.num_attention_heads, arch.num_query_groups
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, H)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, H)
    shapes["model.norm.weight"] = (H,)
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (nh * D, H),
                p + "self_attn.k_proj.weight": (g * D, H),
                p + "self_attn.v_proj.weight": (g * D, H),
                p + "self_attn.o_proj.weight": (H, nh * D),
            }
        )
        if arch.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if not arch.is_moe:
            F = arch.ffn_hidden_size
            shapes.update({p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                           p + "mlp.down_proj.weight": (H, F)})
            continue
        shapes[p + "mlp.gate.weight"] = (E, H)
        if expert_layout == "fused":
            shapes[p + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
            shapes[p + "mlp.experts.down_proj"] = (E, H, I)
        else:
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                shapes[q + "gate_proj.weight"] = (I, H)
                shapes[q + "up_proj.weight"] = (I, H)
                shapes[q + "down_proj.weight"] = (H, I)
    return shapes


def canonical_shapes(arch) -> dict[str, tuple[int, ...]]:
    """Every canonical (TP1/EP1/PP1, sequential-expert) megatron tensor of `arch` and its shape."""
    H, D, E, I = arch.hidden_size, arch.head_dim, arch.num_experts, arch.moe_ffn_hidden_size
    nh, g = arch.num_attention_heads, arch.num_query_groups
    vp = arch.padded_vocab(1)
    shapes = {"embedding.word_embeddings.weight": (vp, H)}
    if not arch.tie_word_embeddings:
        shapes["output_layer.weight"] = (vp, H)
    shapes["decoder.final_layernorm.weight"] = (H,)
    for layer in range(arch.num_layers):
        p = names.layer_prefix(layer)
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "self_attention.linear_qkv.weight": ((nh + 2 * g) * D, H),
                p + "self_attention.linear_proj.weight": (H, nh * D),
                p + "pre_mlp_layernorm.weight": (H,),
            }
        )
        if arch.qk_layernorm:
            shapes.update({p + name: (D,) for name in _QK_NORMS})
        if not arch.is_moe:
            F = arch.ffn_hidden_size
            shapes.update({p + DENSE_FC1: (2 * F, H), p + "mlp.linear_fc2.weight": (H, F)})
            continue
        shapes[p + "mlp.router.weight"] = (E, H)
        for e in range(E):
            shapes[p + names.expert_weight(e, "linear_fc1")] = (2 * I, H)
            shapes[p + names.expert_weight(e, "linear_fc2")] = (H, I)
    return shapes


def detect_expert_layout(names) -> str:
    """'fused' or 'per_expert' from the HF tensor names."""
    names = set(names)
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    per = any(re.search(r"mlp\.experts\.\d+\.gate_proj\.weight$", n) for n in names)
    if fused == per:
        raise ValueError(
            "cannot tell the HF expert layout: expected either mlp.experts.gate_up_proj (fused) or "
            f"mlp.experts.<e>.gate_proj.weight (per expert); found fused={fused} per_expert={per}"
        )
    return "fused" if fused else "per_expert"


def check_hf_tensors(reader: HFReader, arch) -> str:
    """Raise ValueError naming every missing, unexpected or mis-shaped HF tensor.

    Returns the detected expert layout ("per_expert" for a dense model, where it is moot).
    Reads only the safetensors headers.
    """
    layout = detect_expert_layout(reader.keys()) if arch.is_moe else "per_expert"
    want = hf_shapes(arch, layout)
    have = {name: reader.shape(name) for name in reader.keys()}
    problems = []
    problems += [f"missing tensor {n} {tuple(s)}" for n, s in want.items() if n not in have]
    # transformers may persist rotary buffers; they are recomputed on both sides.
    extra = [n for n in have if n not in want and not n.endswith("rotary_emb.inv_freq")]
    problems += [f"unexpected tensor {n} {tuple(have[n])}" for n in extra]
    problems += [
        f"tensor {n} has shape {tuple(have[n])}, expected {tuple(s)}"
        for n, s in want.items()
        if n in have and tuple(have[n]) != tuple(s)
    ]
    if problems:
        raise ValueError(
            "HF checkpoint does not match the architecture:\n  " + "\n  ".join(problems)
        )
    return layout


# ---------------------------------------------------------------------------------------------
# transforms
# ---------------------------------------------------------------------------------------------


def fuse_qkv(q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor, arch) -> torch.Tensor:
    """HF q/k/v [nh*D, H], [g*D, H], [g*D, H] -> megatron linear_qkv [(nh+2g)*D, H]."""
    g, D, H = arch.num_query_groups, arch.head_dim, q_w.shape[-1]
    hpg = arch.num_attention_heads // g
    qkv = torch.cat([q_w.view(g, hpg * D, H), k_w.view(g, D, H), v_w.view(g, D, H)], dim=1)
    return qkv.reshape(-1, H)


def split_qkv(qkv_w: torch.Tensor, arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    g, D, H = arch.num_query_groups, arch.head_dim, qkv_w.shape[-1]
    hpg = arch.num_attention_heads // g
    grouped = qkv_w.view(g, (hpg + 2) * D, H)
    q_w, k_w, v_w = torch.split(grouped, [hpg * D, D, D], dim=1)
    return q_w.reshape(-1, H), k_w.reshape(-1, H), v_w.reshape(-1, H)


def pad_vocab_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad a [V, H] embedding/output matrix to `rows` rows (megatron's padded vocabulary)."""
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


def canonical_from_hf(name: str, reader: HFReader, arch, expert_layout: str) -> torch.Tensor:
    """The full megatron tensor `name` (canonical name), read lazily from the HF checkpoint."""
    if name == "embedding.word_embeddings.weight":
        return pad_vocab_rows(reader.get("model.embed_tokens.weight"), arch.padded_vocab(1))
    if name == "output_layer.weight":  # tied: the last PP stage's copy of the embedding
        return pad_vocab_rows(reader.get(hf_output_name(arch)), arch.padded_vocab(1))
    if name == "decoder.final_layernorm.weight":
        return reader.get("model.norm.weight")
    m = names.LAYER.match(name)
    if m is None:
        raise KeyError(f"not a {arch.family} megatron tensor: {name}")
    layer, rest = int(m.group(1)), m.group(2)
    p = f"model.layers.{layer}."
    direct = _layer_direct(arch)
    if rest in direct:
        return reader.get(p + direct[rest])
    if rest == "self_attention.linear_qkv.weight":
        return fuse_qkv(*(reader.get(p + f"self_attn.{x}_proj.weight") for x in "qkv"), arch)
    if rest == DENSE_FC1 and not arch.is_moe:
        return torch.cat([reader.get(p + "mlp.gate_proj.weight"),
                          reader.get(p + "mlp.up_proj.weight")], 0)
    e_m = names.EXPERT_WEIGHT.match(rest) if arch.is_moe else None
    if e_m is None:
        raise KeyError(f"not a {arch.family} megatron tensor: {name}")
    e, which = int(e_m.group(1)), e_m.group(2)
    if expert_layout == "fused":
        hf_name = p + (
            "mlp.experts.gate_up_proj" if which == "linear_fc1" else "mlp.experts.down_proj"
        )
        return reader.get_index(hf_name, e)
    q = f"{p}mlp.experts.{e}."
    if which == "linear_fc1":
        return torch.cat([reader.get(q + "gate_proj.weight"), reader.get(q + "up_proj.weight")], 0)
    return reader.get(q + "down_proj.weight")


def hf_group_names(arch) -> Iterator[tuple[str, list[str]]]:
    """Export order: (group label, canonical names needed to write that group's HF tensors)."""
    yield "embeddings", ["embedding.word_embeddings.weight"]
    for layer in range(arch.num_layers):
        p = names.layer_prefix(layer)
        group = [p + rest for rest in _layer_direct(arch)]
        group += [p + "self_attention.linear_qkv.weight"]
        group += [p + DENSE_FC1] if not arch.is_moe else []
        group += [
            p + names.expert_weight(e, fc)
            for e in range(arch.num_experts)
            for fc in ("linear_fc1", "linear_fc2")
        ]
        yield f"layer {layer}", group
    yield "head", ["decoder.final_layernorm.weight"] + (
        [] if arch.tie_word_embeddings else ["output_layer.weight"])


def hf_from_canonical(
    tensors: dict[str, torch.Tensor], arch, expert_layout: str
) -> dict[str, torch.Tensor]:
    """HF tensors from one `hf_group_names` group of full canonical megatron tensors."""
    out: dict[str, torch.Tensor] = {}
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[: arch.vocab_size]
        elif name == "output_layer.weight":
            if arch.tie_word_embeddings:
                raise KeyError("output_layer.weight of a tied model: HF has no lm_head (the "
                               "embedding is exported once)")
            out["lm_head.weight"] = t[: arch.vocab_size]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        else:
            m = names.LAYER.match(name)
            if m is None:
                raise KeyError(f"not a {arch.family} megatron tensor: {name}")
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = t
    for layer, rest in by_layer.items():
        p = f"model.layers.{layer}."
        for src, dst in _layer_direct(arch).items():
            if src in rest:
                out[p + dst] = rest.pop(src)
        if DENSE_FC1 in rest and not arch.is_moe:
            gate, up = rest.pop(DENSE_FC1).chunk(2, dim=0)
            out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
        if "self_attention.linear_qkv.weight" in rest:
            q_w, k_w, v_w = split_qkv(rest.pop("self_attention.linear_qkv.weight"), arch)
            out.update(
                {
                    p + "self_attn.q_proj.weight": q_w,
                    p + "self_attn.k_proj.weight": k_w,
                    p + "self_attn.v_proj.weight": v_w,
                }
            )
        unknown = [k for k in rest if not names.EXPERT_WEIGHT.match(k) or not arch.is_moe]
        if unknown:
            raise KeyError(f"not {arch.family} megatron tensors of layer {layer}: {unknown}")
        fc1 = {
            int(names.EXPERT_WEIGHT.match(k).group(1)): v
            for k, v in rest.items()
            if k.endswith("fc1.weight")
        }
        fc2 = {
            int(names.EXPERT_WEIGHT.match(k).group(1)): v
            for k, v in rest.items()
            if k.endswith("fc2.weight")
        }
        if fc1 or fc2:
            if sorted(fc1) != list(range(arch.num_experts)) or sorted(fc2) != sorted(fc1):
                raise ValueError(f"layer {layer}: export needs all {arch.num_experts} experts")
            out.update(_experts_to_hf(p, fc1, fc2, arch, expert_layout))
    return out


def _experts_to_hf(p, fc1, fc2, arch, expert_layout):
    I = arch.moe_ffn_hidden_size
    E = arch.num_experts
    if expert_layout == "fused":
        return {
            p + "mlp.experts.gate_up_proj": torch.stack([fc1[e] for e in range(E)]),
            p + "mlp.experts.down_proj": torch.stack([fc2[e] for e in range(E)]),
        }
    out = {}
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        out[q + "gate_proj.weight"] = fc1[e][:I]
        out[q + "up_proj.weight"] = fc1[e][I:]
        out[q + "down_proj.weight"] = fc2[e]
    return out
