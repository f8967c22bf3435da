"""The converter's name and shard mapping checked at a model's real shapes, without weights.

What: two checks over the converter's own functions, run on meta tensors (shape, no storage), so
the 48-layer, 128-expert Qwen3-30B-A3B costs no memory:

* `check_names(arch, expert_layout)`: every HF tensor name of the architecture (`mapping.hf_shapes`)
  is read by `mapping.canonical_from_hf` for some megatron (canonical) tensor, each canonical
  tensor comes out of it at its `mapping.canonical_shapes` shape, and `mapping.hf_from_canonical`
  over the export groups (`mapping.hf_group_names`) gives back exactly the HF names and shapes:
  none lost, none produced twice, every canonical name in exactly one group.
* `check_shards(arch, sizes, roles)`: for every rank of a layout (`roles`: the rank's (tp, ep, pp,
  dp, expert-dp) coordinates and its model's local parameters, mapped to canonical names by the
  caller with `sharding.canonical_name`), the converter's cut (`sharding.shard`: the import's
  rule; the vocabulary rows padded to `ModelArch.padded_vocab(tp)` as the import's `_vocab_rows`)
  of the full tensor has the shape the model holds; over all ranks the distinct shards of each
  full tensor tile it exactly once (an index probe along the split dimension: every row or
  column held by exactly one shard, and `sharding.assemble` of the shards is the identity); and,
  when the caller passes megatron's own checkpoint metadata (the model's `sharded_state_dict`:
  global offset of the rank's piece), the converter's shard starts where megatron's checkpoint
  says the rank's piece starts, on the split axis, the layer axis (global layer index) and the
  expert axis (global expert index).

Not shown here: the values of the transforms (QKV interleave, [gate; up]); tests/convert runs them
on tiny models with real data. Pure torch (no megatron, no process group); the simulation
(train/sim_convert.py) builds the roles from the fake model of every rank.
"""

from __future__ import annotations

import torch

from megatron_pdm.convert import mapping, names, sharding

__all__ = ["check_names", "check_shards", "full_shape"]


class _MetaReader:
    """An `HFReader` stand-in over `mapping.hf_shapes`: meta tensors, and which names were read."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes, self.read = shapes, set()

    def _meta(self, name: str, shape) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(f"HF tensor {name} is not in the architecture's HF names")
        self.read.add(name)
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    def get(self, name: str) -> torch.Tensor:
        return self._meta(name, self.shapes.get(name, ()))

    def get_index(self, name: str, index: int) -> torch.Tensor:
        shape = self.shapes.get(name, (0,))
        if not 0 <= index < shape[0]:
            raise KeyError(f"HF tensor {name} {shape}: no index {index}")
        return self._meta(name, shape[1:])


def check_names(arch, expert_layout: str) -> dict:
    """HF <-> canonical names and shapes of `arch` both ways (module docstring)."""
    hf = mapping.hf_shapes(arch, expert_layout)
    canon = mapping.canonical_shapes(arch)
    reader = _MetaReader(hf)
    problems = []
    for name, shape in canon.items():
        try:
            t = mapping.canonical_from_hf(name, reader, arch, expert_layout)
        except KeyError as exc:
            problems.append(f"{name}: no HF source ({exc})")
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: built from HF as {tuple(t.shape)}, canonical {shape}")
    problems += [f"HF tensor {n} is read by no megatron tensor" for n in hf if n not in reader.read]
    produced: dict[str, str] = {}
    grouped: dict[str, str] = {}
    for label, group in mapping.hf_group_names(arch):
        for n in group:
            if n in grouped:
                problems.append(f"{n}: in export groups {grouped[n]!r} and {label!r}")
            grouped[n] = label
        full = {n: torch.empty(canon[n], dtype=torch.bfloat16, device="meta") for n in group
                if n in canon}
        problems += [f"export group {label!r}: {n} is not a canonical tensor"
                     for n in group if n not in canon]
        for hf_name, t in mapping.hf_from_canonical(full, arch, expert_layout).items():
            if hf_name in produced:
                problems.append(f"HF tensor {hf_name}: exported by {produced[hf_name]!r} and "
                                f"{label!r}")
            produced[hf_name] = label
            if tuple(t.shape) != tuple(hf.get(hf_name, ())):
                problems.append(f"HF tensor {hf_name}: exported as {tuple(t.shape)}, the "
                                f"architecture has {hf.get(hf_name)}")
    problems += [f"canonical {n}: in no export group" for n in canon if n not in grouped]
    problems += [f"HF tensor {n}: never exported" for n in hf if n not in produced]
    return {"expert_layout": expert_layout, "hf_tensors": len(hf), "canonical_tensors": len(canon),
            "hf_elements": sum(_numel(s) for s in hf.values()), "problems": problems}


def full_shape(canonical: str, arch, tp: int, canon: dict | None = None) -> tuple[int, ...]:
    """The full megatron tensor at TP `tp`: the canonical shape, vocabulary rows padded to TP
    (`canon`: `mapping.canonical_shapes(arch)`, when the caller has it)."""
    shape = tuple((canon or mapping.canonical_shapes(arch))[canonical])
    if sharding.rule_for(canonical).vocab_padded:
        shape = (arch.padded_vocab(tp),) + shape[1:]
    return shape


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _split_dim(split: str | None) -> int | None:
    return {"dim0": 0, "dim1": 1, "fc1": 0}.get(split)


def _index_count(rule, role: dict, sizes: dict) -> tuple[int, int]:
    """The shard (index, count) of a rank under `rule` (TP for dense, expert-TP for experts)."""
    if rule.group == "etp":
        return role["etp"], sizes["etp"]
    if rule.group == "tp":
        return role["tp"], sizes["tp"]
    return 0, 1


def _probe(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """An index tensor along `dim` (size 1 elsewhere): what `shard` keeps of that dimension."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return torch.arange(shape[dim]).reshape(view)


def _tiling_problems(name: str, shape, split: str, count: int) -> list[str]:
    """Every index of the split dimension in exactly one of `count` shards; assemble = identity."""
    dim = _split_dim(split)
    probe = _probe(shape, dim)
    parts = [sharding.shard(probe, split, i, count) for i in range(count)]
    held = torch.bincount(torch.cat([p.reshape(-1) for p in parts]), minlength=shape[dim])
    problems = []
    if not bool((held == 1).all()):
        twice, never = int((held > 1).sum()), int((held == 0).sum())
        problems.append(f"{name}: the {count} shards of dim {dim} ({shape[dim]}) hold {twice} "
                        f"indices more than once and miss {never}")
    if not torch.equal(sharding.assemble(split, parts), probe):
        problems.append(f"{name}: sharding.assemble of its {count} shards is not the full tensor")
    return problems


def _offset_problems(name: str, rule, index: int, count: int, full, local_shape,
                     megatron) -> list[str]:
    """The converter's shard start against megatron's checkpoint offset of the same piece."""
    global_shape, offset, prepend = megatron
    m = names.LAYER.match(name)
    problems = []
    if m is not None and prepend >= 1 and offset[0] != int(m.group(1)):
        problems.append(f"{name}: megatron's checkpoint puts this layer at index {offset[0]}")
    e_m = names.LOCAL_EXPERT.match(m.group(2)) if m is not None else None
    if e_m is not None and prepend >= 2 and offset[1] != int(e_m.group(1)):
        problems.append(f"{name}: megatron's checkpoint puts this expert at index {offset[1]}")
    if tuple(global_shape[prepend:]) != tuple(full):
        problems.append(f"{name}: megatron's checkpoint tensor is {tuple(global_shape[prepend:])}"
                        f" per piece, the converter's full tensor {tuple(full)}")
    dim = _split_dim(rule.split if count > 1 else None)
    if dim is not None and rule.split != "fc1":  # fc1 [gate_r; up_r] is two pieces: factory
        start = int(sharding.shard(_probe(full, dim), rule.split, index, count).min())
        if offset[prepend + dim] != start:
            problems.append(f"{name}: the converter's shard {index}/{count} starts at {start} on "
                            f"dim {dim}, megatron's checkpoint piece at {offset[prepend + dim]}")
    return problems


def check_shards(arch, sizes: dict, roles: list[dict]) -> dict:
    """Every rank's shards against the converter's cut and tiling (module docstring).

    `sizes`: {"tp", "ep", "etp", "pp", "world"}; each role: {"rank", "tp", "ep", "etp", "pp",
    "dp", "edp", "params": {canonical: local shape}, "megatron": {canonical: (global shape,
    global offset, prepended axes)} (optional)}.
    """
    canon = mapping.canonical_shapes(arch)
    problems: list[str] = []
    holders: dict[str, dict[int, int]] = {}  # canonical -> shard index -> ranks holding it
    stages: dict[str, set[int]] = {}
    checked_offsets = 0
    for role in roles:
        where = f"rank {role['rank']} (tp {role['tp']}, ep {role['ep']}, pp {role['pp']})"
        for name, local in role["params"].items():
            if sharding.is_tied_copy(name, arch):
                continue
            if name not in canon:
                problems.append(f"{where}: {name} is not a canonical {arch.family} tensor")
                continue
            rule = sharding.rule_for(name)
            index, count = _index_count(rule, role, sizes)
            full = full_shape(name, arch, sizes["tp"], canon)
            cut = sharding.shard(torch.empty(full, device="meta"), rule.split if count > 1
                                 else None, index, count)
            if tuple(cut.shape) != tuple(local):
                problems.append(f"{where}: {name}: the converter cuts {tuple(cut.shape)}, the "
                                f"model holds {tuple(local)}")
            meg = role.get("megatron", {}).get(name)
            if meg is not None:
                problems += [f"{where}: {p}" for p in
                             _offset_problems(name, rule, index, count, full, local, meg)]
                checked_offsets += 1
            by_index = holders.setdefault(name, {})
            by_index[index] = by_index.get(index, 0) + 1
            stages.setdefault(name, set()).add(role["pp"])
    tiled: dict[tuple, list[str]] = {}
    for name in canon:
        if sharding.is_tied_copy(name, arch):
            continue
        if name not in holders:
            problems.append(f"{name}: held by no rank")
            continue
        if len(stages[name]) != 1:
            problems.append(f"{name}: held on pipeline stages {sorted(stages[name])}")
        rule = sharding.rule_for(name)
        count = _index_count(rule, {"tp": 0, "etp": 0}, sizes)[1]
        if sorted(holders[name]) != list(range(count)):
            problems.append(f"{name}: shards {sorted(holders[name])} held, expected 0..{count - 1}")
        if len(set(holders[name].values())) != 1:
            problems.append(f"{name}: its shards have unequal replica counts {holders[name]}")
        if count > 1:
            full = full_shape(name, arch, sizes["tp"], canon)
            key = (full, rule.split, count)
            if key not in tiled:
                tiled[key] = _tiling_problems(name, full, rule.split, count)
            problems += tiled[key]
    replicas = sorted({n for by in holders.values() for n in by.values()})
    return {"ranks": len(roles), "canonical_tensors": len(canon),
            "shards": sum(len(r["params"]) for r in roles), "replica_counts": replicas,
            "megatron_offsets_checked": checked_offsets, "problems": problems}
