"""A checkpoint save planned on a simulated rank: the driver's state dict, megatron's save plan, no
data written.

What: `plan_rank(ddp, optimizer, rank=)` builds the state dict `Trainer.save` writes
(`mcore.checkpoint.checkpoint_state`: the model's and the distributed optimizer's sharded state
dicts) and runs megatron's save path up to the write: `save_preprocess` (factories applied,
non-persistent and common parts split off), the torch_dist strategy's key translation and
`mcore_to_pyt_state_dict`, and DCP's local plan (`MCoreSavePlanner.create_local_plan`): the write
items (tensor chunks with global offsets) this rank would write. It returns the rank's bytes by
part (model / optimizer), its shard records (key, global shape, offset, local shape, main replica)
and the optimizer-side check below. `coverage(records_by_rank)` checks, over the ranks given, that
the main replicas of every model tensor tile its global shape exactly once.

What is skipped and why: megatron's `validate_sharding_integrity` and DCP's global plan gather
every rank's metadata (`all_gather_object` / `gather_object`), which one simulated rank cannot
answer (the fake process group has no other ranks); the coverage is checked here instead over the
metadata of every simulated rank's model (train/sim_convert.py builds them) and, for the optimizer,
by megatron's distributed-optimizer rule: DP rank k owns slice [k*L, (k+1)*L) of each bucket
(L = the bucket's padded numel / DP), cut at the bucket's unpadded numel U, which is the global
shape of its checkpoint tensors. The write itself (storage I/O) is not run.
"""

from __future__ import annotations

import re

_OPT_KEY = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_\d+\."
                      r"gbuf_idx_(\d+)\..*\.bucket_idx_(\d+)\.(\w+)$")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def records(sharded_part) -> tuple[list[tuple], int]:
    """(key, dtype itemsize, global shape, global offset, box shape, main replica) of every
    ShardedTensor, and the number of ShardedObjects (pickled objects, not tensors)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    out, objects = [], 0
    for v in nested_values(sharded_part):
        if not isinstance(v, ShardedTensor):
            objects += 1
            continue
        if v.flattened_range is not None:
            raise ValueError(f"checkpoint plan: {v.key} has a flattened range (not planned here)")
        box = (1,) * v.prepend_axis_num + tuple(v.local_shape)
        out.append((v.key, v.dtype.itemsize, tuple(v.global_shape), tuple(v.global_offset), box,
                    bool(is_main_replica(v.replica_id))))
    return out, objects


def model_records(module) -> list[tuple]:
    """`records` of a model's own sharded state dict (factories applied, as a save does)."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    sd = module.sharded_state_dict()
    apply_factories(sd)
    return records(sd)[0]


def coverage(records_by_rank: list[list[tuple]]) -> dict:
    """Every key's main replicas over the given ranks tile its global shape exactly once.

    A key's main boxes must agree on global shape and itemsize, lie inside the tensor, sit on one
    grid (same box shape, offsets multiples of it) at distinct places, and their volumes sum to
    the tensor's; 1-D keys of unequal pieces (none in a model) are checked as sorted intervals.
    """
    by_key: dict[str, list[tuple]] = {}
    for recs in records_by_rank:
        for key, size, gshape, offset, box, main in recs:
            if main:
                by_key.setdefault(key, []).append((size, gshape, offset, box))
    problems, total = [], 0
    for key, boxes in sorted(by_key.items()):
        size, gshape = boxes[0][0], boxes[0][1]
        if any(b[0] != size or b[1] != gshape for b in boxes):
            problems.append(f"{key}: ranks disagree on its global shape or dtype")
            continue
        total += _numel(gshape) * size
        shapes = {b[3] for b in boxes}
        if len(shapes) == 1:
            box = next(iter(shapes))
            cells = set()
            for _, _, off, _ in boxes:
                if any(o % s or o + s > g for o, s, g in zip(off, box, gshape)):
                    problems.append(f"{key}: piece at {off} {box} is off the grid of {gshape}")
                cells.add(off)
            if len(cells) != len(boxes):
                problems.append(f"{key}: {len(boxes) - len(cells)} pieces written twice")
            if len(cells) * _numel(box) != _numel(gshape):
                problems.append(f"{key}: pieces cover {len(cells) * _numel(box):,} of "
                                f"{_numel(gshape):,} elements")
        elif len(gshape) == 1:
            problems += _interval_problems(key, [(b[2][0], b[2][0] + b[3][0]) for b in boxes],
                                           0, gshape[0])
        else:
            problems.append(f"{key}: pieces of unequal shapes {sorted(shapes)} (not checked)")
    return {"keys": len(by_key), "total_bytes": total, "problems": problems}


def _interval_problems(key: str, spans: list[tuple[int, int]], start: int, stop: int) -> list[str]:
    """`spans` tile [start, stop) exactly once."""
    at = start
    for a, b in sorted(spans):
        if a != at:
            return [f"{key}: {'overlap' if a < at else 'gap'} at {min(a, at)} (pieces tile "
                    f"[{start}, {stop}) except there)"]
        at = b
    return [] if at == stop else [f"{key}: pieces end at {at}, expected {stop}"]


def _optimizer_check(recs: list[tuple], optimizer) -> tuple[list[str], int, dict]:
    """The distributed optimizer's pieces on this rank against megatron's DP-slice rule (module
    docstring); returns (problems, bytes of the whole world's optimizer state by the rule, keys
    per sub-optimizer)."""
    from megatron_pdm.mcore import optimizer as mopt

    subs = mopt.sub_optimizers(optimizer)
    spans: dict[str, list] = {}
    meta: dict[str, tuple] = {}
    for key, size, gshape, offset, box, main in recs:
        m = _OPT_KEY.match(key)
        if m is None:
            continue
        spans.setdefault(key, []).append((offset[0], offset[0] + box[0]))
        meta[key] = (int(m.group(1) or 0), int(m.group(2)), int(m.group(3)), size, gshape[0])
    problems, world_bytes, keys = [], 0, {}
    import torch.distributed as dist

    world = dist.get_world_size()
    for key, (i, gbuf, bucket, size, unpadded) in sorted(meta.items()):
        sub = subs[i]
        dp, d = sub.data_parallel_group.size(), sub.data_parallel_group.rank()
        padded = sub.buffers[gbuf].buckets[bucket].grad_data.numel()
        local = padded // dp
        start, stop = min(d * local, unpadded), min((d + 1) * local, unpadded)
        problems += _interval_problems(key, spans[key], start, stop)
        if dp * local < unpadded:
            problems.append(f"{key}: {dp} DP slices of {local} do not cover {unpadded}")
        # every DP group of the layout holds the same buckets (the ranks of a stage hold the
        # same shapes, checked by the conversion plan): world / DP groups of this size
        world_bytes += unpadded * size * (world // dp)
        keys[f"sub_{i}"] = keys.get(f"sub_{i}", 0) + 1
    return problems, world_bytes, keys


def plan_rank(ddp, optimizer, *, rank: int, train_state: dict | None = None) -> dict:
    """This rank's save plan at its real shapes, no data written (module docstring)."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    from megatron_pdm.mcore.checkpoint import checkpoint_state

    # the trainer's common state is small host data (counters, RNG): a placeholder here
    state = checkpoint_state(ddp, optimizer, train_state or {"iteration": 0, "step": 0})
    # megatron's save, steps before the write; the integrity check needs every rank (docstring)
    sharded_part, common = save_preprocess(state, validate_access_integrity=False)
    recs, objects = records(sharded_part)
    strategy = get_default_save_sharded_strategy()
    keep_main = getattr(strategy, "keep_only_main_replica", True)
    translated, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_main)
    planner = MCoreSavePlanner(dedup_replicated_tensors=not keep_main, flatten_state_dict=False)
    planner.set_up_planner(mcore_to_pyt_state_dict(translated, False), is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    by_part = {"model": 0, "optimizer": 0}
    items = {"tensor_chunks": 0, "objects": 0}
    for item in plan.items:
        if item.tensor_data is None:
            items["objects"] += 1
            continue
        items["tensor_chunks"] += 1
        nbytes = _numel(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        by_part["optimizer" if _OPT_KEY.match(item.index.fqn) else "model"] += nbytes
    opt_problems, opt_world_bytes, opt_keys = _optimizer_check(recs, optimizer)
    return {"strategy": f"{strategy.backend} v{strategy.version}",
            "keep_only_main_replica": keep_main, "write_items": items, "bytes": by_part,
            "sharded_objects": objects, "common_keys": sorted(common),
            "optimizer_keys": opt_keys, "optimizer_world_bytes_by_rule": opt_world_bytes,
            "optimizer_problems": opt_problems,
            "model_records": [r for r in recs if not _OPT_KEY.match(r[0])]}
