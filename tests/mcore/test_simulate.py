"""The fake-tensor simulation (megatron-pdm-simulate): real widths, reduced depth, TP 2 / EP 2.

One RL optimizer step of the Qwen3-30B-A3B recipe's arguments (the real hidden size, heads,
expert width and vocabulary; 2 layers, 8 experts, 256 tokens) on simulated rank 0 (megatron's
output layer) and rank 3 (the fused head) of a world of 4: every parameter's shard shape, the
loss op's input shapes (vocabulary shard 76,032 by the one padding rule) and the simulated bytes of parameters, gradients and optimizer state
against the analytic count of megatron_pdm.layout.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess

import pytest
import torch

from megatron_pdm import layout
from megatron_pdm.arch import ModelArch
from megatron_pdm.mcore.sim_shapes import check_param_shapes, expected_param_shape

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "qwen3_30b_a3b" / "train_pdm.sh"


def _recipe_args() -> list[str]:
    out = subprocess.run(["bash", str(RECIPE), "--print-args"], capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout.split("\n")[:-1]


def _simulate(tmp_path, ranks: str, *extra: str) -> dict:
    from megatron_pdm.tools.simulate import main

    rc = main(["--world", "4", "--ranks", ranks, "--num-layers", "2", "--num-experts", "8",
               "--seq-length", "256", "--micro-batch", "1", "--output-dir", str(tmp_path),
               *_recipe_args(), "--set", "parallel.tp=2", "--set", "parallel.ep=2", *extra])
    result = json.loads((tmp_path / "simulate.json").read_text())
    assert rc == 0, [r["param_shape_problems"] + r["loss_input_problems"] for r in result["ranks"]]
    assert (tmp_path / "simulate.md").exists()
    return result


@pytest.mark.parametrize("fused_head,ranks", [(False, "0"), (True, "3")])
def test_simulated_step_shapes_and_static_memory(tmp_path, monkeypatch, fused_head, ranks):
    from megatron.core import parallel_state as ps

    # a stale megatron parallel state left by an earlier user of this process (its process
    # group already destroyed) must not stop the simulation
    monkeypatch.setattr(ps, "_DATA_PARALLEL_GROUP", object())
    result = _simulate(tmp_path, ranks, "--set", f"train.fused_head={str(fused_head).lower()}")
    assert result["vocab_shard"] == 76032 and result["dp"] == 2
    arch = ModelArch.qwen3_30b_a3b()
    arch = dataclasses.replace(arch, num_layers=2, num_experts=8)
    lay = layout.validate_layout(arch, world_size=4, tp=2, pp=1, ep=2)
    dense, expert = layout.param_counts(arch, lay)
    for r in result["ranks"]:
        assert r["param_shape_problems"] == [] and r["loss_input_problems"] == []
        assert r["num_params"] == dense + expert
        b = r["bytes"]
        assert b["parameters"] == 2 * (dense + expert)  # bf16
        assert b["gradients"] == 4 * (dense + expert)  # fp32 main grads
        # distributed optimizer: fp32 main params + Adam moments, 12 B/param over DP (dense)
        # and expert-DP (experts); megatron pads each bucket's shard, so allow that slack
        want = 12 * dense // lay.dp + 12 * expert // lay.expert_dp
        got = b["optimizer_main_params"] + b["optimizer_adam_state"]
        assert want <= got <= want * 1.01, (got, want)
        assert b["activations_peak"] > 0
        # the checkpoint Trainer.save would write after the step (mcore/ckpt_plan.py): rank 0
        # (DP rank 0, expert-DP rank 0) holds the main replica of every tensor it has and writes
        # them all; rank 3 (DP rank 1, expert-DP rank 1) holds replicas only and writes no model
        # bytes (megatron's save writes main replicas; no fully-parallel save wrapper)
        cp = r["checkpoint_plan"]
        want_model = b["parameters"] if r["rank"] == 0 else 0
        assert cp["optimizer_problems"] == [] and cp["bytes"]["model"] == want_model
        # fp32 main params + Adam moments, without the buckets' DP padding
        assert 0.99 * got <= cp["bytes"]["optimizer"] <= got, (cp["bytes"], got)
        width = arch.hidden_size if fused_head else 76032
        assert r["loss_inputs"]["output_tensor"] == [1, 256, width]
        if fused_head:
            assert r["loss_inputs"]["head_weight"] == [76032, arch.hidden_size]
    # world 4 = DP 2 x TP 2; EP 2 over the TP-DP ranks: rank 3 is TP rank 1, EP rank 1
    want = {"0": (0, 0, 0), "3": (1, 1, 1)}[ranks]
    r = result["ranks"][0]["ranks"]
    assert (r["tp"], r["ep"], r["dp"]) == want


def test_shape_check_names_a_wrong_shard():
    arch = ModelArch.qwen3_30b_a3b()
    assert expected_param_shape("embedding.word_embeddings.weight", arch, tp=4, ep=8) == (
        38016, 2048)
    assert expected_param_shape("output_layer.weight", arch, tp=2, ep=1) == (76032, 2048)
    model = torch.nn.Module()
    model.register_parameter("output_layer", None)
    model.embedding = torch.nn.Module()
    model.embedding.word_embeddings = torch.nn.Linear(2048, 37984, bias=False)  # unpadded / TP
    problems = check_param_shapes(model, arch, tp=4, ep=8)
    assert problems == ["embedding.word_embeddings.weight: built (37984, 2048), expected "
                        "(38016, 2048)"]
