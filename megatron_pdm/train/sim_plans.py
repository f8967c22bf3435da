"""The plans section of `megatron-pdm-simulate --convert-plan`: conversion, checkpoint, weight sync.

What: `plans(cfg, arch, world, rank_reports)` builds the fake model of every rank of the world
(train/sim_convert.py) and returns the conversion plan (`convert/plan.py`), the checkpoint plan
(the model part's coverage over the world, `mcore/ckpt_plan.coverage`; with the simulated ranks'
own save plans (`simulate_rank`'s `checkpoint_plan`): their bytes, the optimizer's DP-slice check
and the checkpoint's total size) and the weight-sync bucket plan, each with its problems;
`markdown(result)` renders them for simulate.md. `problems(section)` lists every failed check.
"""

from __future__ import annotations

import time

from megatron_pdm.arch import ModelArch
from megatron_pdm.train import sim_convert
from megatron_pdm.train.config import RunConfig

GIB = 2**30


def plans(cfg: RunConfig, arch: ModelArch, world: int, rank_reports: list[dict],
          own_records: dict[int, list]) -> dict:
    """The three plans (module docstring); `rank_reports` may be empty (no simulated step),
    `own_records`: each simulated rank's model records from its save plan (the trainer's
    DDP-wrapped model), compared with the bare model's of the same rank."""
    p = cfg.parallel
    t0 = time.time()
    roles = sim_convert.rank_roles(cfg, arch, world)
    build_s = round(time.time() - t0, 1)
    sizes = {"tp": p.tp, "ep": p.ep, "etp": 1, "pp": p.pp, "world": world}
    conversion = sim_convert.conversion_plan(arch, sizes, roles)
    model_cov = sim_convert.checkpoint_coverage(roles)
    ckpt = {"model_keys": model_cov["keys"], "model_total_bytes": model_cov["total_bytes"],
            "problems": list(model_cov["problems"]), "ranks": []}
    for r in rank_reports:
        cp = r.get("checkpoint_plan")
        if not cp:
            continue
        own = sorted(own_records.get(r["rank"], []))
        if own != sorted(roles[r["rank"]]["ckpt_records"]):
            ckpt["problems"].append(f"rank {r['rank']}: the trainer's model state dict differs "
                                    "from the bare model's of the same rank")
        ckpt["problems"] += [f"rank {r['rank']}: {x}" for x in cp["optimizer_problems"]]
        ckpt["ranks"].append({"rank": r["rank"], **{k: cp[k] for k in (
            "bytes", "write_items", "sharded_objects", "strategy", "optimizer_world_bytes_by_rule")}})
    if ckpt["ranks"] and p.pp == 1:
        # every DP group holds the same buckets at PP 1 (all ranks hold the same shapes)
        opt = ckpt["ranks"][0]["optimizer_world_bytes_by_rule"]
        ckpt["optimizer_total_bytes"] = opt
        ckpt["total_bytes"] = model_cov["total_bytes"] + opt
    sync = sim_convert.weight_sync_plan(cfg, arch, roles)
    return {"roles_build_s": build_s, "conversion": conversion, "checkpoint": ckpt,
            "weight_sync": sync}


def problems(section: dict) -> list[str]:
    """Every failed check of a `plans` result."""
    return (section["conversion"]["problems"] + section["checkpoint"]["problems"]
            + section["weight_sync"]["problems"])


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


def markdown(section: dict) -> list[str]:
    """simulate.md's sections of the plans."""
    c, k, w = section["conversion"], section["checkpoint"], section["weight_sync"]
    s = c["shards"]
    lines = ["", "## Conversion plan (HF <-> megatron names and shards)", "",
             f"Fake model of every rank built in {section['roles_build_s']} s; checks "
             f"{c['check_s']} s.", ""]
    for layout, n in c["names"].items():
        lines.append(f"- HF layout `{layout}`: {n['hf_tensors']:,} HF tensors "
                     f"({n['hf_elements']:,} elements) <-> {n['canonical_tensors']:,} megatron "
                     f"tensors; problems: {len(n['problems'])}")
    lines += [f"- shards: {s['shards']:,} local parameters on {s['ranks']} ranks checked against "
              f"the converter's cut, {s['megatron_offsets_checked']:,} also against megatron's "
              f"checkpoint offsets; replicas per shard {s['replica_counts']}; problems: "
              f"{len(s['problems'])}", ""]
    lines += [f"  - {p}" for p in c["problems"][:20]]
    lines += ["## Checkpoint save plan (megatron dist-checkpointing, nothing written)", "",
              f"- model part over the world: {k['model_keys']:,} keys, "
              f"{_gib(k['model_total_bytes'])}; optimizer state (distributed optimizer, by its "
              f"DP-slice rule): {_gib(k.get('optimizer_total_bytes'))}; checkpoint total "
              f"{_gib(k.get('total_bytes'))}"
              + ("" if k.get("total_bytes") else " (no simulated step, or PP > 1)")
              + f"; problems: {len(k['problems'])}"]
    for r in k["ranks"]:
        lines.append(f"- rank {r['rank']} writes {_gib(r['bytes']['model'])} model + "
                     f"{_gib(r['bytes']['optimizer'])} optimizer in "
                     f"{r['write_items']['tensor_chunks']:,} tensor chunks and "
                     f"{r['write_items']['objects']} objects ({r['strategy']})")
    lines += [f"  - {p}" for p in k["problems"][:20]]
    over = ", ".join(f"{o['name']} {o['bytes'] / 2**20:,.0f} MiB" for o in w["tensors_over_bucket"])
    sent = [v for rank, v in w["gather_bytes_sent_to_rank0"].items() if int(rank) != 0]
    lines += ["", "## Weight-sync bucket plan (SGLang, one sync)", "",
              f"- settings: mode {w['mode']}, backend {w['backend']}, bucket_mb {w['bucket_mb']},"
              f" load_format {w['load_format']}, push dtype {w['push_dtype']}",
              f"- {w['tensors']:,} HF tensors in {w['buckets']} buckets; largest bucket "
              f"{w['largest_bucket_bytes'] / 2**20:,.0f} MiB; {_gib(w['bytes_per_sync'])} pushed "
              f"per sync", f"- tensors larger than a bucket (a bucket of their own): "
              f"{over or 'none'}",
              f"- gather to rank 0: the other ranks send at most {_gib(max(sent, default=0))} "
              f"each, {_gib(sum(sent))} together; problems: {len(w['problems'])}", ""]
    lines += [f"  - {p}" for p in w["problems"][:20]]
    return lines
