"""Megatron's naming and tensor-parallel sharding rules for every `arch.ModelArch` family (Qwen3-MoE,
dense Qwen3, Llama), in one table.

Checkpoint import cuts a rank's part out of a full tensor (`shard`); the live export and the
weight sync to the inference engines glue the parts of all ranks back together (`assemble`).
Both read the split of a tensor from `RULES`, and both map a rank's local parameter name onto
the canonical name (global layer, global expert; `mapping.py` documents canonical <-> HF) with
`canonical_name`. Per canonical-name pattern:

    pattern (canonical megatron name)           HF source (mapping.py)     split    over
    embedding.word_embeddings.weight            model.embed_tokens         vocab    TP   dim 0, rows padded
    output_layer.weight                         lm_head (tied: the         vocab    TP   dim 0, rows padded
                                                embedding, see below)
    *.self_attention.linear_qkv.weight          q/k/v_proj (per-group      dim0     TP   (column parallel)
                                                fused, see mapping.fuse_qkv)
    *.self_attention.linear_proj.weight         o_proj                     dim1     TP   (row parallel)
    *.mlp.linear_fc1 (dense)                    [gate_proj; up_proj]       fc1      TP   rank r: [gate_r; up_r]
    *.mlp.linear_fc2 (dense)                    down_proj                  dim1     TP   (row parallel)
    *.mlp.experts.local_experts.E.linear_fc1    [gate; up] of expert E     fc1      ETP  rank r: [gate_r; up_r]
    *.mlp.experts.local_experts.E.linear_fc2    down of expert E           dim1     ETP  (row parallel)
    everything else (norms, router)             one-to-one                 None     -    replicated

Tied embeddings: with PP > 1 the last stage holds `output_layer.weight`, megatron's copy of the
embedding (kept equal to it through the embedding group); it is filled from the embedding on import
and never exported or synced (`is_tied_copy`): stage 0 sends the embedding itself.

Experts are further split over EP by whole experts: EP rank k holds global experts
[k * E/EP, (k+1) * E/EP); `canonical_name` turns the local index into the global one.
Names of the Transformer Engine spec (grouped experts, QKV-fused input norm) are mapped onto the
local spec by `canonical_local_name` first.

Pure torch: the caller passes ranks and sizes (no parallel_state here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm.convert import names

__all__ = ["RULES", "Rule", "assemble", "canonical_local_name", "canonical_name", "is_tied_copy",
           "rule_for", "shard"]

VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Rule:
    """How the tensors whose canonical name ends with `suffix` are split.

    Attributes:
        suffix: canonical-name ending the rule applies to.
        split: "dim0" / "dim1" (even split along that dimension), "fc1" (split of [gate; up]:
            rank r holds [gate_r; up_r]) or None (replicated).
        group: "tp" (dense tensor parallel), "etp" (expert tensor parallel) or None.
        vocab_padded: rows padded to megatron's padded vocabulary (embedding, output layer).
    """

    suffix: str
    split: str | None
    group: str | None
    vocab_padded: bool = False


RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", "dim0", "tp", vocab_padded=True),
    Rule("output_layer.weight", "dim0", "tp", vocab_padded=True),
    Rule("self_attention.linear_qkv.weight", "dim0", "tp"),
    Rule("self_attention.linear_proj.weight", "dim1", "tp"),
    Rule("mlp.linear_fc1.weight", "fc1", "tp"),  # dense MLP (an expert's ends local_experts.e.*)
    Rule("mlp.linear_fc2.weight", "dim1", "tp"),
    Rule("linear_fc1.weight", "fc1", "etp"),  # experts
    Rule("linear_fc2.weight", "dim1", "etp"),
)
_REPLICATED = Rule("", None, None)


def rule_for(canonical: str) -> Rule:
    """The sharding rule of one canonical tensor name (replicated when no pattern matches)."""
    for rule in RULES:
        if canonical.endswith(rule.suffix):
            return rule
    return _REPLICATED


def is_tied_copy(canonical: str, arch) -> bool:
    """The last PP stage's copy of a tied embedding (no tensor of its own on either side)."""
    return canonical == "output_layer.weight" and arch.tie_word_embeddings


def shard(full: torch.Tensor, split: str | None, index: int, count: int) -> torch.Tensor:
    """Rank `index`'s part (of `count`) of the full tensor under `split` (the scatter)."""
    if split is None:
        return full
    if split == "dim0":
        return full.chunk(count, dim=0)[index]
    if split == "dim1":
        return full.chunk(count, dim=1)[index]
    if split == "fc1":  # [gate; up]: each rank gets [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(count, 0)[index], up.chunk(count, 0)[index]], dim=0)
    raise ValueError(f"unknown split {split!r}")


def assemble(split: str | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from all ranks' parts, in rank order (the gather; inverse of `shard`)."""
    if split is None:
        return parts[0]
    if split == "dim0":
        return torch.cat(parts, dim=0)
    if split == "dim1":
        return torch.cat(parts, dim=1)
    if split == "fc1":
        gates = [t.chunk(2, dim=0)[0] for t in parts]  # each part is [gate_r; up_r]
        ups = [t.chunk(2, dim=0)[1] for t in parts]
        return torch.cat(gates + ups, dim=0)
    raise ValueError(f"unknown split {split!r}")


_TE_RENAMES = {
    # TE fuses the input norm into the QKV linear; the local spec has a separate norm.
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    # dense layers: TE fuses the pre-MLP norm into linear_fc1 likewise
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}


def canonical_local_name(name: str) -> str:
    """A parameter name of either layer spec -> the local-spec name (same layer/expert indices).

    TE's grouped experts `mlp.experts.linear_fc1.weight{j}` become
    `mlp.experts.local_experts.{j}.linear_fc1.weight`; TE's QKV-fused input norm becomes
    `input_layernorm.weight`, its fc1-fused pre-MLP norm (dense) `pre_mlp_layernorm.weight`. Local-spec names pass through.
    """
    m = names.TE_EXPERT.match(name)
    if m is not None:
        return f"{m.group(1)}local_experts.{m.group(3)}.{m.group(2)}.weight"
    for src, dst in _TE_RENAMES.items():
        if name.endswith(src):
            return name[: -len(src)] + dst
    return name


def canonical_name(module: torch.nn.Module, local_name: str, *, experts_per_rank: int,
                   ep_rank: int) -> str:
    """Local-spec parameter name on this rank -> canonical name (global layer and expert).

    The layer's global index is its `layer_number - 1` (pipeline stages hold disjoint layers);
    local expert j of EP rank k is global expert `k * experts_per_rank + j`.
    """
    m = names.LAYER.match(local_name)
    if m is None:
        return local_name
    layer = module.decoder.layers[int(m.group(1))]
    rest = m.group(2)
    e_m = names.LOCAL_EXPERT.match(rest)
    if e_m is not None:
        rest = f"mlp.experts.local_experts.{ep_rank * experts_per_rank + int(e_m.group(1))}." \
               f"{e_m.group(2)}"
    return names.layer_prefix(layer.layer_number - 1) + rest
