"""The plans of `megatron-pdm-simulate --convert-plan` at the recipe's real widths and vocabulary.

Qwen3-30B-A3B's hidden size, heads, expert width and vocabulary (151,936, padded to 152,064 at
TP 4 by `ModelArch.padded_vocab`) with 2 layers and 8 experts, at the recipe's TP 4 / EP 8 (world
8, PP 1) and at PP 2 (world 16): the converter's name and shard mapping on every rank, the model
part of the checkpoint tiling every global tensor, the weight-sync bucket plan. Each check is
also shown to fail: a swapped shard dimension, a lost HF name, a missing rank, a smaller bucket.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess

import pytest

from megatron_pdm.arch import ModelArch
from megatron_pdm.convert import mapping, plan, sharding

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "qwen3_30b_a3b" / "train_pdm.sh"


def _recipe_args() -> list[str]:
    out = subprocess.run(["bash", str(RECIPE), "--print-args"], capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout.split("\n")[:-1]


def _cfg(*sets: str):
    from megatron_pdm.train.config import RunConfig

    args = _recipe_args()
    overrides = [a for i, a in enumerate(args) if i > 0 and args[i - 1] == "--set"]
    return RunConfig.load(args[1], overrides + list(sets))


ARCH = dataclasses.replace(ModelArch.qwen3_30b_a3b(), num_layers=2, num_experts=8)


@pytest.fixture(scope="module")
def roles_pp1():
    from megatron_pdm.train import sim_convert

    return sim_convert.rank_roles(_cfg(), ARCH, 8)


def _sizes(pp: int = 1, world: int = 8) -> dict:
    return {"tp": 4, "ep": 8, "etp": 1, "pp": pp, "world": world}


@pytest.mark.parametrize("pp,world", [(1, 8), (2, 16)])
def test_convert_plan_command_at_real_widths(tmp_path, pp, world):
    from megatron_pdm.tools.simulate import main

    rc = main(["--world", str(world), "--num-layers", "2", "--num-experts", "8",
               "--convert-plan", "--no-step", "--output-dir", str(tmp_path), *_recipe_args(),
               "--set", f"parallel.pp={pp}"])
    result = json.loads((tmp_path / "simulate.json").read_text())
    plans = result["plans"]
    assert rc == 0, (plans["conversion"]["problems"], plans["checkpoint"]["problems"],
                     plans["weight_sync"]["problems"])
    assert result["padded_vocab"] == 152064 and result["vocab_shard"] == 38016
    shards = plans["conversion"]["shards"]
    assert shards["ranks"] == world and shards["problems"] == []
    assert shards["megatron_offsets_checked"] > 0
    # 8 layers-worth of names: HF per-expert 69 tensors at 2 layers / 8 experts
    assert plans["conversion"]["names"]["per_expert"]["hf_tensors"] == 3 + 2 * (9 + 3 * 8)
    assert plans["checkpoint"]["problems"] == [] and plans["checkpoint"]["model_keys"] > 0
    sync = plans["weight_sync"]
    assert sync["tensors"] == 3 + 2 * (9 + 3 * 8) and sync["problems"] == []
    # the embedding and the output layer, 151,936 x 2,048 bf16, exceed the recipe's 512 MiB
    assert sorted(o["name"] for o in sync["tensors_over_bucket"]) == [
        "lm_head.weight", "model.embed_tokens.weight"]
    assert "## Conversion plan" in (tmp_path / "simulate.md").read_text()


def test_every_rank_holds_the_padded_vocabulary_shard(roles_pp1):
    for r in roles_pp1:
        assert r["params"]["embedding.word_embeddings.weight"] == (38016, 2048)
        assert r["megatron"]["embedding.word_embeddings.weight"][1] == (38016 * r["tp"], 0)
    assert plan.full_shape("output_layer.weight", ARCH, 4) == (152064, 2048)


def test_a_swapped_shard_dimension_fails(roles_pp1, monkeypatch):
    assert plan.check_shards(ARCH, _sizes(), roles_pp1)["problems"] == []
    rules = tuple(dataclasses.replace(r, split="dim0")
                  if r.suffix == "self_attention.linear_proj.weight" else r for r in sharding.RULES)
    monkeypatch.setattr(sharding, "RULES", rules)
    problems = plan.check_shards(ARCH, _sizes(), roles_pp1)["problems"]
    assert any("linear_proj.weight: the converter cuts (512, 4096), the model holds (2048, 1024)"
               in p for p in problems), problems[:3]


def test_a_wrong_expert_index_fails(roles_pp1):
    # megatron's checkpoint numbers EP rank 1's expert as global expert 1; a converter that
    # numbered it 0 (EP rank ignored) would disagree with that offset
    bad = [dict(r, megatron=dict(r["megatron"])) for r in roles_pp1]
    owner = next(r for r in bad if r["ep"] == 1)
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    shape, offset, prepend = owner["megatron"][name]
    owner["megatron"][name] = (shape, (offset[0], 0) + offset[2:], prepend)
    problems = plan.check_shards(ARCH, _sizes(), bad)["problems"]
    assert problems == [f"rank {owner['rank']} (tp {owner['tp']}, ep 1, pp 0): {name}: "
                        "megatron's checkpoint puts this expert at index 0"]


def test_a_lost_hf_name_fails(monkeypatch):
    assert plan.check_names(ARCH, "per_expert")["problems"] == []
    direct = dict(mapping._LAYER_DIRECT)
    direct["self_attention.k_layernorm.weight"] = "self_attn.q_norm.weight"  # k_norm -> q_norm
    monkeypatch.setattr(mapping, "_LAYER_DIRECT", direct)
    problems = plan.check_names(ARCH, "per_expert")["problems"]
    assert "HF tensor model.layers.0.self_attn.k_norm.weight is read by no megatron tensor" \
        in problems
    # export: both norms land on q_norm (one overwrites the other), k_norm is never written
    assert "HF tensor model.layers.1.self_attn.k_norm.weight: never exported" in problems


def test_checkpoint_coverage_fails_without_a_rank(roles_pp1):
    from megatron_pdm.mcore import ckpt_plan

    full = ckpt_plan.coverage([r["ckpt_records"] for r in roles_pp1])
    assert full["problems"] == []
    # bf16 model over the world: every padded vocabulary row once, every expert once
    dense, expert = 2 * 152064 * 2048 * 2, 2 * 8 * 3 * 2048 * 768 * 2
    assert full["total_bytes"] > dense + expert
    partial = ckpt_plan.coverage([r["ckpt_records"] for r in roles_pp1[1:]])
    assert any("pieces cover" in p for p in partial["problems"]), partial["problems"][:3]
    doubled = ckpt_plan.coverage([r["ckpt_records"] for r in roles_pp1 + roles_pp1[:1]])
    assert any("written twice" in p for p in doubled["problems"]), doubled["problems"][:3]


def test_optimizer_slices_tile_their_dp_share():
    from megatron_pdm.mcore.ckpt_plan import _interval_problems

    assert _interval_problems("k", [(10, 20), (0, 10)], 0, 20) == []
    assert _interval_problems("k", [(0, 10), (12, 20)], 0, 20) == [
        "k: gap at 10 (pieces tile [0, 20) except there)"]
    assert _interval_problems("k", [(0, 12), (10, 20)], 0, 20)[0].startswith("k: overlap at 10")


def test_bucket_plan_follows_the_bucket_size(roles_pp1):
    from megatron_pdm.train import sim_convert

    cfg = _cfg("rollout.sglang.weight_sync.bucket_mb=64")
    sync = sim_convert.weight_sync_plan(cfg, ARCH, roles_pp1)
    assert sync["problems"] == [] and sync["bucket_mb"] == 64
    qkv = (32 + 2 * 4) * 128 * 2048 * 2  # 20 MiB: under 64 MiB
    names = {o["name"] for o in sync["tensors_over_bucket"]}
    assert "model.embed_tokens.weight" in names and all(
        o["bytes"] > 64 << 20 for o in sync["tensors_over_bucket"]) and qkv < 64 << 20
    assert sync["largest_bucket_bytes"] == 151936 * 2048 * 2
