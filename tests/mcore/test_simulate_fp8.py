"""The FP8 recipe in the fake-tensor simulation (mcore/sim_fp8.py): real widths, 2 layers, 8
experts.

`train_pdm_fp8.sh`'s arguments (e4m3, blockwise) at TP 2 / EP 2, world 4, rank 0: the step runs
on the local spec's bf16 linears (stand-in F1), the FP8 GEMM shape rule is checked on every
operand of the layers' linears with no violation, the requested 200 tokens are padded by the
driver's rule (`seq_multiple`: TP 2 x 128-row blocks = 256), and TE's FP8 weight copies (F2) are
held as their own category of exactly the bytes computed here from the architecture. A config
whose expert width breaks TE's 16-divisibility (776) is reported, naming the module and shape.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess

from megatron_pdm.arch import ModelArch

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "qwen3_30b_a3b" / "train_pdm_fp8.sh"


def _run(tmp_path, *extra: str, recipe=RECIPE, seq: int = 200) -> tuple[int, dict]:
    from megatron_pdm.tools.simulate import main

    args = subprocess.run(["bash", str(recipe), "--print-args"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.split("\n")[:-1]
    fp8 = "precision.fp8_recipe=blockwise" in args and "precision.fp8=e4m3" in args
    assert fp8 == (recipe == RECIPE)
    rc = main(["--world", "4", "--ranks", "0", "--num-layers", "2", "--num-experts", "8",
               "--seq-length", str(seq), "--micro-batch", "1", "--output-dir", str(tmp_path),
               *args, "--set", "parallel.tp=2", "--set", "parallel.ep=2", *extra])
    return rc, json.loads((tmp_path / "simulate.json").read_text())


def _copy_bytes(rows: int, cols: int) -> int:
    """uint8 data + fp32 scale per 128 x 128 block."""
    return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)


def test_fp8_step_checks_gemm_shapes_and_holds_weight_copies(tmp_path):
    rc, result = _run(tmp_path)
    r = result["ranks"][0]
    assert rc == 0, r.get("fp8", {}).get("gemm_check", {}).get("violations")
    assert (result["seq_length_requested"], result["seq_multiple"], result["seq_length"]) == (
        200, 256, 256)
    assert r["loss_inputs"]["output_tensor"] == [1, 256, 76032]
    f = r["fp8"]
    assert (f["format"], f["recipe"]) == ("e4m3", "blockwise")
    g = f["gemm_check"]
    assert g["violations"] == []
    a = ModelArch.qwen3_30b_a3b()
    h, d, i, tp, local_experts, layers = a.hidden_size, a.head_dim, a.moe_ffn_hidden_size, 2, 4, 2
    qkv_rows = (a.num_attention_heads + 2 * a.num_query_groups) * d // tp
    proj_cols = a.num_attention_heads * d // tp
    weights = {"self_attention.linear_qkv": (qkv_rows, h),
               "self_attention.linear_proj": (h, proj_cols),
               "mlp.experts.*.linear_fc1": (2 * i, h), "mlp.experts.*.linear_fc2": (h, i)}
    assert set(g["kinds"]) == set(weights)  # no embedding, output layer, router or norm
    tokens = 256 * 1  # s * b after padding
    rows = {"self_attention.linear_qkv": tokens // tp,  # SP: the local rows, before the gather
            "self_attention.linear_proj": tokens}
    for kind, (out_f, in_f) in weights.items():
        k = g["kinds"][kind]
        n = layers * (local_experts if "*" in kind else 1)
        # forward and recompute's forward (train.recompute=full), one backward
        assert (k["modules"], k["forward_calls"], k["backward_calls"]) == (n, 2 * n, n), (kind, k)
        assert k["weight_shapes"] == [[out_f, in_f]], (kind, k)
        for shape in k["input_shapes"]:
            assert shape[-1] == in_f and math.prod(shape[:-1]) % 128 == 0, (kind, k)
        if kind in rows:
            assert [math.prod(s[:-1]) for s in k["input_shapes"]] == [rows[kind]], (kind, k)
    # balanced routing (drop-and-pad at capacity 1): T*k/E rows per expert, as measured
    assert g["kinds"]["mlp.experts.*.linear_fc1"]["raw_input_rows"] == [
        tokens // tp * a.moe_router_topk // 8 * 2]  # x EP: both EP ranks' slots per expert
    want = layers * (_copy_bytes(*weights["self_attention.linear_qkv"])
                     + _copy_bytes(*weights["self_attention.linear_proj"])
                     + local_experts * (_copy_bytes(2 * i, h) + _copy_bytes(h, i)))
    assert r["bytes"]["fp8_weight_copies"] == want
    assert f["weight_copies"] == {"weights": layers * (2 + 2 * local_experts),
                                  "tensors": 2 * layers * (2 + 2 * local_experts), "bytes": want}
    # the copies were live in the step's tracker: without them the peak is the BF16 recipe's
    # at the same shapes (the same bf16 build runs)
    assert f["step_peak_with_weight_copies"] == r["bytes"]["activations_peak"] + want
    rc, bf16 = _run(tmp_path / "bf16", recipe=RECIPE.with_name("train_pdm.sh"), seq=256)
    assert rc == 0 and "fp8" not in bf16["ranks"][0] and bf16["seq_length"] == 256
    b16 = bf16["ranks"][0]["bytes"]
    assert b16["fp8_weight_copies"] == 0
    assert b16["activations_peak"] == r["bytes"]["activations_peak"], (b16, r["bytes"])
    row = {c["category"]: c for c in r["compare"]}["fp8 weight copies"]
    assert row["simulated"] == want and row["dry_run"] > 0
    assert "FP8 ERROR" not in (tmp_path / "simulate.md").read_text()


def test_fp8_gemm_shape_violation_is_reported(tmp_path):
    """An expert width of 776 (not a multiple of 16): fc2's input and weight break TE's rule."""
    rc, result = _run(tmp_path, "--set", "model.moe_ffn_hidden_size=776")
    assert rc == 1
    v = result["ranks"][0]["fp8"]["gemm_check"]["violations"]
    named = {(x["module"].removeprefix("module."), x["problem"]) for x in v}
    fc2 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2"
    assert (fc2, "weight [2048, 776]: assert_dim_for_fp8_exec needs leading dims' product "
                 "(2048) % 8 == 0 and last dim (776) % 16 == 0") in named, named
    assert any(m == fc2 and p.startswith("input [256, 776]") for m, p in named), named
    assert all("linear_fc2" in m for m, _ in named), named  # fc1's [1552, 2048] is fine
    assert "FP8 ERROR" in (tmp_path / "simulate.md").read_text()
