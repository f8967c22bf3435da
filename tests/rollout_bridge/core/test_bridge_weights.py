"""Rollout-precision transforms and the safetensors writer (exact properties, not tolerances)."""

from __future__ import annotations

import json
import os

import torch

from rollout_bridge.core.weights import (
    FP8_E4M3_MAX,
    fake_quant_fp8,
    load_safetensors_dir,
    round_to_bf16,
    save_hf_safetensors,
)


def test_bf16_round_is_idempotent_and_nearest():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    y = round_to_bf16(x)
    assert y.dtype == torch.float32 and torch.equal(round_to_bf16(y), y)
    assert ((x - y).abs() <= x.abs() * 2.0 ** -8).all()


def test_fp8_block_scales():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    w[:128, :128] *= 1000.0                       # one loud block must not crush the others
    q = fake_quant_fp8(w, 128)
    assert q.shape == w.shape and q.dtype == w.dtype
    quiet = (slice(128, 300), slice(128, 200))
    rel = ((q[quiet] - w[quiet]).abs() / w[quiet].abs().max()).max()
    assert 0 < rel <= 2.0 ** -4                    # e4m3: 3 mantissa bits
    per_tensor = fake_quant_fp8(w, None)
    rel_pt = ((per_tensor[quiet] - w[quiet]).abs() / w[quiet].abs().max()).max()
    assert rel_pt > rel                             # per-tensor scale loses the quiet blocks
    # block max maps exactly to +-448 * scale -> representable, reproduced exactly
    amax = w[:128, :128].abs().max()
    assert q[:128, :128].abs().max() == amax
    assert torch.equal(fake_quant_fp8(q, 128), q)  # idempotent
    assert fake_quant_fp8(torch.zeros(4, 4)).abs().sum() == 0
    assert FP8_E4M3_MAX == float(torch.finfo(torch.float8_e4m3fn).max)


def test_save_and_load_sharded(tmp_path):
    sd = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(4)}
    sd["step"] = torch.tensor([3])
    out = save_hf_safetensors(sd, str(tmp_path / "ckpt"), max_shard_bytes=64 * 64 * 2 * 2,
                              config={"vocab_size": 50}, metadata={"weight_version": "3"})
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and "config.json" in files
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(sd)
    loaded = load_safetensors_dir(out)
    assert loaded["layer.0.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["layer.2.weight"].float(), round_to_bf16(sd["layer.2.weight"]))
    assert torch.equal(loaded["step"], sd["step"])
    assert not any(f.endswith(".tmp") for f in files)


def test_driver_engine_simulates_sglangs_online_fp8_scales(monkeypatch):
    """SGLang's `--quantization fp8` on a BF16 checkpoint quantises per tensor (per expert) on load;
    the driver's local engine simulates that by default (rollout.local.fp8_scales="tensor") and
    128x128 blocks only when asked (an FP8 checkpoint's scales)."""
    from megatron_pdm.train.rollout import local as rollout
    from megatron_pdm.train.rollout.config import LocalRolloutConfig
    from megatron_pdm.train.rollout.local import build_engine

    # the driver's device (mcore/device.py) is the CPU shim's "cpu" here; the shim itself is not
    # installed in this process
    monkeypatch.setattr(rollout, "current_device", lambda: torch.device("cpu"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256, bias=False)
    with torch.no_grad():
        lin.weight[:128, :128] *= 50  # one block with a much larger range than the rest
    weight = lin.weight.detach().clone()
    assert LocalRolloutConfig().fp8_scales == "tensor"
    for scales, block in (("tensor", None), ("block128", 128)):
        engine = build_engine(lin, vocab_size=256, top_logprobs=2, seed=0, rollout_precision="fp8",
                              eos_id=0, pad_id=0, tp_size=1,
                              fp8_block_size=None if scales == "tensor" else 128)
        engine.update_weights({"gpt.weight": weight}, version="1")
        assert torch.equal(engine.model.gpt.weight, fake_quant_fp8(weight, block)), scales
    assert not torch.equal(fake_quant_fp8(weight, None), fake_quant_fp8(weight, 128))
