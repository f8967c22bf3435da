"""The conversion plan, the world's checkpoint coverage and the weight-sync bucket plan of a recipe,
from the fake model of every rank of its world (no weights, no data).

What: `rank_roles(cfg, arch, world)` builds, for every rank of the world, that rank's GPTModel on
fake tensors (`mcore/fake_sim.fake_world`, the trainer's `transformer_config` and `build_model`
as in train/simulate.py; no DDP, no optimizer: a model costs seconds) and keeps only metadata:
the rank's coordinates, each parameter's canonical name (`sharding.canonical_name`, as the
import and the live export map it) and local shape, megatron's own checkpoint metadata of the
model (`mcore/ckpt_plan.model_records`) and the live export's manifest (`convert/live.py`: which
shard of which tensor this rank sends to rank 0 in a weight sync). From those roles:

* `conversion_plan`: `convert/plan.check_names` (both HF expert layouts) and
  `convert/plan.check_shards` (every rank's shard against the converter's cut and tiling, and
  against megatron's checkpoint offsets);
* `checkpoint_coverage`: `ckpt_plan.coverage` of every rank's model records (the model part of
  the checkpoint tiles each global tensor exactly once over the world) and its total bytes;
* `weight_sync_plan`: the live export's gather (`live.iter_hf_groups`'s order and assembly, on
  meta tensors: no collective) fed through the driver's bucketing (`rollout_bridge.sglang.
  broadcast.buckets`, `rollout.sglang.weight_sync.bucket_mb`) in the push dtype: bucket count, the
  largest bucket, bytes per sync, every tensor larger than a bucket, and per rank the bytes it
  sends to rank 0 in the gather.
"""

from __future__ import annotations

import time

import torch

from megatron_pdm.arch import ModelArch
from megatron_pdm.convert import live, mapping, plan, sharding
from megatron_pdm.mcore import ckpt_plan, fake_sim
from megatron_pdm.mcore.model import build_model, transformer_config
from megatron_pdm.train import model_setup as ms
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.rollout.sglang import push_dtype_name


def _role(cfg: RunConfig, arch: ModelArch, rank: int) -> dict:
    """This (fake) rank's coordinates, canonical params, checkpoint records and live manifest."""
    from megatron.core import parallel_state as ps

    p = cfg.parallel
    kwargs = dict(ms.megatron_kwargs(cfg), **fake_sim.balanced_routing_overrides(arch))
    tconfig = transformer_config(arch, tp=p.tp, ep=p.ep, pp=p.pp, calculate_per_token_loss=True,
                                 perform_initialization=False, use_cpu_initialization=True,
                                 **kwargs)
    gpt = build_model(arch, tconfig, use_te=False,
                      pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
                      post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
                      fused_head=cfg.train.fused_head)
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    params, local_of = {}, {}
    for name, t in gpt.named_parameters():
        canon = sharding.canonical_name(gpt, sharding.canonical_local_name(name),
                                        experts_per_rank=(arch.num_experts or 0) // ep,
                                        ep_rank=ep_rank)
        params[canon] = tuple(t.shape)
        local_of[name] = canon
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    megatron = {}  # canonical -> (global shape, offset, prepended axes) of its checkpoint piece
    for name, sh in gpt.sharded_state_dict().items():
        if isinstance(sh, ShardedTensor) and name in local_of:
            megatron[local_of[name]] = (tuple(sh.global_shape), tuple(sh.global_offset),
                                        sh.prepend_axis_num)
    manifest = {n: spec for n, (_, spec) in live._local_manifest(gpt, arch).items()}
    return {"rank": rank, "tp": ps.get_tensor_model_parallel_rank(), "ep": ep_rank,
            "etp": ps.get_expert_tensor_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank(), "params": params, "megatron": megatron,
            "ckpt_records": ckpt_plan.model_records(gpt), "manifest": manifest}


def rank_roles(cfg: RunConfig, arch: ModelArch, world: int) -> list[dict]:
    """`_role` of every rank 0..world-1, one fake world after the other."""
    p = cfg.parallel
    roles = []
    for rank in range(world):
        with fake_sim.fake_world(rank=rank, world=world, tp=p.tp, ep=p.ep, pp=p.pp):
            roles.append(_role(cfg, arch, rank))
    return roles


def conversion_plan(arch: ModelArch, sizes: dict, roles: list[dict]) -> dict:
    """`plan.check_names` for both HF expert layouts and `plan.check_shards` over the roles."""
    t0 = time.time()
    names = {layout: plan.check_names(arch, layout) for layout in mapping.EXPERT_LAYOUTS}
    shards = plan.check_shards(arch, sizes, roles)
    return {"names": names, "shards": shards, "check_s": round(time.time() - t0, 1),
            "problems": [p for n in names.values() for p in n["problems"]] + shards["problems"]}


def checkpoint_coverage(roles: list[dict]) -> dict:
    """The model part of the checkpoint over the whole world (`ckpt_plan.coverage`)."""
    return ckpt_plan.coverage([r["ckpt_records"] for r in roles])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".")[-1])


def weight_sync_plan(cfg: RunConfig, arch: ModelArch, roles: list[dict]) -> dict:
    """The push of one weight sync, planned on meta tensors (module docstring)."""
    from rollout_bridge.sglang.broadcast import buckets

    ws = cfg.rollout.sglang.weight_sync
    push_dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[push_dtype_name(cfg)])
    owners: dict[str, list] = {}
    sent = {r["rank"]: 0 for r in roles}
    for r in roles:  # the manifests live.iter_hf_groups gathers (collective 1 there)
        for name, spec in r["manifest"].items():
            owners.setdefault(name, []).append((r["rank"], spec))
            if r["rank"] != 0:  # collective 2 there: a point-to-point send to rank 0
                sent[r["rank"]] += _numel(spec.shape) * _dtype(spec.dtype).itemsize
    problems: list[str] = []

    def named():
        for label, group in mapping.hf_group_names(arch):
            full = {}
            for name in group:
                if name not in owners:
                    problems.append(f"{name}: no rank sends it")
                    continue
                parts = sorted(owners[name], key=lambda o: o[1].index)
                spec = parts[0][1]
                if spec.split is not None and len(parts) != spec.count:
                    problems.append(f"{name}: {len(parts)} of {spec.count} shards sent")
                    continue
                full[name] = sharding.assemble(spec.split, [
                    torch.empty(s.shape, dtype=_dtype(s.dtype), device="meta") for _, s in parts])
            for hf_name, t in mapping.hf_from_canonical(full, arch, "per_expert").items():
                yield hf_name, t.to(push_dtype)

    bucket_bytes = ws.bucket_mb << 20
    want = mapping.hf_shapes(arch, "per_expert")
    pushed: dict[str, tuple] = {}
    sizes, over = [], []
    for b in buckets(named(), bucket_bytes):
        sizes.append(b.nbytes)
        for name, t in zip(b.names, b.tensors):
            if name in pushed:
                problems.append(f"HF tensor {name} pushed twice")
            pushed[name] = tuple(t.shape)
            nbytes = t.numel() * t.element_size()
            if nbytes > bucket_bytes:
                over.append({"name": name, "bytes": nbytes})
    problems += [f"HF tensor {n} not pushed" for n in want if n not in pushed]
    problems += [f"HF tensor {n} pushed as {pushed[n]}, the architecture has {want[n]}"
                 for n in want if n in pushed and pushed[n] != tuple(want[n])]
    return {"bucket_mb": ws.bucket_mb, "load_format": ws.load_format, "backend": ws.backend,
            "mode": ws.mode, "push_dtype": push_dtype_name(cfg), "buckets": len(sizes),
            "largest_bucket_bytes": max(sizes, default=0), "bytes_per_sync": sum(sizes),
            "tensors": len(pushed), "tensors_over_bucket": over,
            "gather_bytes_sent_to_rank0": sent, "problems": problems}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
