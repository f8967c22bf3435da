"""Live export: the trainer's sharded megatron model -> full HF-named tensors on one rank, no disk.

What every weight sync to an inference engine needs (SGLang `update_weights_from_distributed`,
vLLM's worker reload, the disk path too): the current weights under HF names (any `arch.ModelArch` family), whole,
on the rank that talks to the engine. This module gathers them from the live model at any
TP / EP / ETP / PP layout, one `mapping.hf_group_names` group at a time (embeddings, one decoder
layer, head), so at most one layer's full tensors exist at once, and converts each group with
the same `mapping.hf_from_canonical` the checkpoint exporter uses.

Who sends what (decided once per call from this rank's parameters; the split of each tensor
is `sharding.RULES`, the table the checkpoint import cuts with):
  * a tensor split over TP (embedding and output rows, fused QKV rows, attention output
    columns) is sent by every TP rank of data-parallel rank 0;
  * an expert tensor is sent by every expert-TP rank of expert-data-parallel rank 0 (its EP rank
    decides which global experts it holds);
  * a tied model's output layer is the embedding: only the embedding is sent;
  * a replicated tensor (norms, router) is sent by TP rank 0 of data-parallel rank 0;
  * pipeline stages hold disjoint layers, so each stage sends its own.

Collectives (all on the default group; every rank calls `iter_hf_groups` and consumes every
group in the same order, even when it receives nothing):
  1. one `all_gather_object` of the manifests {canonical name: shard spec} (small, per call);
  2. per shard one point-to-point `send` (owner) / `recv` (destination), in one global order;
     the destination receives in that order, so the exchange cannot deadlock.

Names: the local (CPU) spec and the Transformer Engine spec are both mapped onto megatron's
canonical names (`sharding.canonical_local_name`); an unknown parameter name is an error, never
skipped.

Shape legend: V_pad padded vocab, H hidden, D head dim, I expert FFN width.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_pdm.arch import ModelArch
from megatron_pdm.convert import mapping, sharding
from megatron_pdm.convert.sharding import canonical_local_name

__all__ = ["ShardSpec", "canonical_local_name", "gather_hf_state_dict", "iter_hf_groups"]


@dataclass(frozen=True)
class ShardSpec:
    """How one rank's tensor sits inside the full canonical tensor.

    Attributes:
        split: None (whole tensor), "dim0" / "dim1" (even split over `count` ranks along that
            dimension), or "fc1" (expert-TP split of [gate; up]: rank r holds [gate_r; up_r]).
        index: this shard's position among the `count` shards.
        count: number of shards.
        shape: the local shard's shape.
        dtype: the local shard's dtype (e.g. "torch.bfloat16").
    """

    split: str | None
    index: int
    count: int
    shape: tuple[int, ...]
    dtype: str


def _local_manifest(module: torch.nn.Module, arch: ModelArch
                    ) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
    """This rank's contributions: canonical name -> (local tensor, its shard spec)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    etp, etp_rank = (ps.get_expert_tensor_parallel_world_size(),
                     ps.get_expert_tensor_parallel_rank())
    edp_rank = ps.get_expert_data_parallel_rank()
    ep, ep_rank = (ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_model_parallel_rank())
    known = set(mapping.canonical_shapes(arch))
    out: dict[str, tuple[torch.Tensor, ShardSpec]] = {}
    for local_name, param in module.named_parameters():
        canon = sharding.canonical_name(module, canonical_local_name(local_name),
                                        experts_per_rank=arch.num_experts // ep, ep_rank=ep_rank)
        if sharding.is_tied_copy(canon, arch):
            continue  # the last stage's copy of the tied embedding: stage 0 sends the embedding
        if canon not in known:
            raise KeyError(f"live export: parameter {local_name!r} (canonical {canon!r}) is not a "
                           f"{arch.family} tensor this exporter knows")
        tensor = param.detach()
        rule = sharding.rule_for(canon)  # the same table the checkpoint import cuts with
        if rule.group is None:  # replicated: TP rank 0 of data-parallel rank 0 sends it
            if dp_rank != 0 or tp_rank != 0:
                continue
            spec = ShardSpec(None, 0, 1, tuple(tensor.shape), str(tensor.dtype))
        else:  # split over (E)TP: every (E)TP rank of (expert-)data-parallel rank 0 sends
            count, index, data_rank = ((etp, etp_rank, edp_rank) if rule.group == "etp"
                                       else (tp, tp_rank, dp_rank))
            if data_rank != 0:
                continue
            spec = ShardSpec(rule.split if count > 1 else None, index, count,
                             tuple(tensor.shape), str(tensor.dtype))
        if canon in out:
            raise AssertionError(f"live export: two local parameters map to {canon}")
        out[canon] = (tensor, spec)
    return out


def _assemble(parts: list[tuple[ShardSpec, torch.Tensor]]) -> torch.Tensor:
    parts = sorted(parts, key=lambda p: p[0].index)
    spec = parts[0][0]
    if spec.split is not None and len(parts) != spec.count:
        raise AssertionError(f"live export: {len(parts)} of {spec.count} shards arrived")
    return sharding.assemble(spec.split, [t for _, t in parts])


def iter_hf_groups(module: torch.nn.Module, arch: ModelArch, *, dst: int = 0,
                   dtype: torch.dtype | None = None, expert_layout: str = "per_expert",
                   device: torch.device | str | None = None
                   ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yields (group label, {HF name: full tensor}) for every export group, in order.

    Collective: every rank of the default group must call it and exhaust the iterator. On `dst`
    the dict holds the group's HF tensors (vocab padding stripped, cast to `dtype`, on `device`:
    default the parameters' device); on every other rank it is empty.

    Args:
        module: this rank's (unwrapped) GPTModel.
        arch: the model's architecture (vocab size for the padding, head layout for QKV).
        dst: global rank that receives the tensors.
        dtype: output dtype (None keeps the parameters' dtype).
        expert_layout: "per_expert" (hub/SGLang/vLLM names) or "fused" (transformers 5.x).
    """
    rank = dist.get_rank()
    local = _local_manifest(module, arch)
    specs = {name: spec for name, (_, spec) in local.items()}
    # Collective 1: every rank learns who holds which shard (names and specs, no tensor data).
    manifests: list[dict[str, ShardSpec]] = [None] * dist.get_world_size()  # type: ignore
    dist.all_gather_object(manifests, specs)
    owners: dict[str, list[tuple[int, ShardSpec]]] = {}
    for src, manifest in enumerate(manifests):
        for name, spec in manifest.items():
            owners.setdefault(name, []).append((src, spec))
    ref = next(iter(local.values()))[0] if local else torch.empty(0)
    for label, names in mapping.hf_group_names(arch):
        full: dict[str, torch.Tensor] = {}
        for name in names:
            if name not in owners:
                raise AssertionError(f"live export: no rank holds {name}")
            parts = []
            for src, spec in owners[name]:
                if src == rank:
                    if rank == dst:
                        parts.append((spec, local[name][0]))
                    else:
                        # Collective 2 (point-to-point): owner -> destination, global order.
                        dist.send(local[name][0].contiguous(), dst=dst)
                elif rank == dst:
                    buf = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype.split(".")[1]),
                                      device=ref.device)
                    dist.recv(buf, src=src)
                    parts.append((spec, buf))
            if rank == dst:
                full[name] = _assemble(parts)
        if rank != dst:
            yield label, {}
            continue
        hf = mapping.hf_from_canonical(full, arch, expert_layout)
        yield label, {k: v.to(dtype=dtype or v.dtype, device=device or v.device).contiguous()
                      for k, v in hf.items()}
        del full, hf


def gather_hf_state_dict(module: torch.nn.Module, arch: ModelArch, *, dst: int = 0,
                         dtype: torch.dtype | None = None, expert_layout: str = "per_expert",
                         device: torch.device | str | None = "cpu") -> dict[str, torch.Tensor]:
    """The whole HF state dict on `dst` (empty elsewhere). Collective; small models only."""
    out: dict[str, torch.Tensor] = {}
    for _, group in iter_hf_groups(module, arch, dst=dst, dtype=dtype,
                                   expert_layout=expert_layout, device=device):
        out.update(group)
    return out
