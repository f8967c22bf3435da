"""The fake-tensor simulation (megatron-pdm-simulate): real widths, reduced depth, TP 2 / EP 2.

One RL optimizer step of the Qwen3-30B-A3B recipe's arguments (the real hidden size, heads,
expert width and vocabulary; 2 layers, 8 experts, 256 tokens) on simulated rank 0 (megatron's
output layer) and rank 3 (the fused head) of a world of 4: every parameter's shard shape, the
loss op's input shapes (vocabulary shard 76,032 by the one padding rule) and the simulated bytes of parameters, gradients and optimizer state
against the analytic count of megatron_pdm.layout; the collective list (the loss op's are
all-reduces of per-token tensors over TP, docs/op.md) and no host tensor meeting a device one
(mcore/sim_devices.py).
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
    assert rc == 0, [r["param_shape_problems"] + r["loss_input_problems"] + r["device_violations"]
                     for r in result["ranks"]]
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
        assert r["device_violations"] == [], r["device_violations"]  # no host tensor met a device one
        assert r["device_ops"] > 0
        _check_loss_collectives(r, vocab_dims={arch.vocab_size, 152064, 76032})
        kinds = {(c["op"], c["kind"]) for c in r["collectives"]}
        # DDP's gradient reduce-scatter and the distributed optimizer's parameter all-gather
        assert {("reduce_scatter_single", "DP"), ("reduce_scatter_single", "expert-DP"),
                ("all_gather_single", "DP"), ("all_gather_single", "expert-DP"),
                ("all_to_all_single", "EP")} <= kinds, kinds
    # world 4 = DP 2 x TP 2; EP 2 over the TP-DP ranks: rank 3 is TP rank 1, EP rank 1
    want = {"0": (0, 0, 0), "3": (1, 1, 1)}[ranks]
    r = result["ranks"][0]["ranks"]
    assert (r["tp"], r["ep"], r["dp"]) == want


def test_simulated_pipeline_stages(tmp_path):
    """PP 2 (world 4 = TP 2 x PP 2, EP 2): the first stage (rank 0) and the last (rank 2) run
    megatron's 1F1B schedule, their activations and gradients sent and received over the
    pipeline group through the fake process group."""
    result = _simulate(tmp_path, "0,2", "--set", "parallel.pp=2")
    first, last = result["ranks"]
    assert (first["ranks"]["pp"], last["ranks"]["pp"]) == (0, 1)
    assert first["loss_inputs"] == {}  # no output layer, no loss on the first stage
    assert last["loss_inputs"]["output_tensor"] == [1, 256, 76032]
    arch = dataclasses.replace(ModelArch.qwen3_30b_a3b(), num_layers=2, num_experts=8)
    _check_loss_collectives(last, vocab_dims={arch.vocab_size, 152064, 76032})
    # the hidden states between the stages and their gradient: [s / TP, b, H] bf16 (sequence
    # parallel), sent and received over the PP group of 2 ranks; both stages send and receive
    for r in result["ranks"]:
        p2p = [c for c in r["collectives"] if c["op"].startswith(("isend", "irecv"))]
        assert {c["op"].split()[0] for c in p2p} == {"isend", "irecv"}, p2p
        for c in p2p:
            assert (c["kind"], c["group_size"], c["shapes"], c["dtype"]) == (
                "PP", 2, [[128, 1, 2048]], "bfloat16"), c
    for r in result["ranks"]:
        assert r["device_violations"] == [] and r["param_shape_problems"] == []


def _check_loss_collectives(r: dict, *, vocab_dims: set[int]) -> None:
    """docs/op.md's collective budget at the recipe's shapes: the loss op (inside our loss_func,
    or called from megatron_pdm/loss/ or parallel/, forward and backward) communicates only
    all-reduces over the TP group of per-token tensors, never a vocabulary-sized one."""
    def of_loss(c):
        return c["phase"] == "loss" or any(s.startswith(("megatron_pdm/loss/",
                                                         "megatron_pdm/parallel/"))
                                           for s in c["sites"])

    loss = [c for c in r["collectives"] if of_loss(c)]
    assert loss, "no collective of the loss op recorded (TP 2 must reduce its statistics)"
    for c in loss:
        assert c["op"] == "all_reduce" and c["kind"] == "TP" and c["group_size"] == 2, c
        assert c["phase"] == "loss", c  # none in backward
        assert not vocab_dims & {d for s in c["shapes"] for d in s}, c
    # the two forward all-reduces: MAX of [N] and SUM of [N, S+3] (N = 256 tokens, S = the
    # batch's 20 support slots, rollout.top_logprobs)
    assert sorted((c["reduce_op"], tuple(c["shapes"][0]), c["count"]) for c in loss) == [
        ("max", (256,), 1), ("sum", (256, 23), 1)], loss


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
