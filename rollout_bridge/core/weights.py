"""Rollout-precision weight transforms and the HF-safetensors hand-off to SGLang.

What:
  * `round_to_bf16`: bf16 rounding (round-to-nearest-even) of fp32 weights, returned in the
    original dtype so compute can stay fp32.
  * `fake_quant_fp8`: simulated FP8 e4m3 (OCP `float8_e4m3fn`, max 448): per-tensor scale, or
    per 128x128 block scale for 2-D weights (DeepSeek-V3 / SGLang "block FP8" style), quantized
    with torch's float8 cast and dequantized back.
  * `apply_rollout_precision`: the above over a state dict (floating tensors only).
  * `save_hf_safetensors` / `load_safetensors_dir`: what the trainer writes for
    `/update_weights_from_disk` (sharded `model-0000x-of-0000n.safetensors` + index json, config
    json copied when given).

Why: real rollout engines run the policy in bf16 or FP8 while the trainer keeps fp32 master
weights. Applying the same rounding to the CPU engine's copy makes behavior and training
policies differ the way they do in production, so off-policy corrections are exercised on CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping

import torch

from megatron_pdm.intmath import ceil_div

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0
ROLLOUT_PRECISIONS = (None, "fp32", "bf16", "fp8")


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Rounds to the nearest bf16 value, keeping x's dtype (fp32 in, bf16-exact fp32 out)."""
    return x.to(torch.bfloat16).to(x.dtype)


def _fp8_roundtrip(x_scaled: torch.Tensor) -> torch.Tensor:
    return x_scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def fake_quant_fp8(x: torch.Tensor, block_size: int | None = 128) -> torch.Tensor:
    """Simulated FP8 e4m3 quantize -> dequantize.

    Scale = amax / 448 per tensor (block_size None, or tensors that are not 2-D) or per
    [block_size, block_size] tile of a 2-D weight (edge tiles are smaller). Zero tiles keep
    scale 1.

    Args:
        x: Weight tensor (any float dtype).
        block_size: Tile edge for 2-D tensors; None for one per-tensor scale.

    Returns:
        Dequantized tensor with x's dtype and shape.
    """
    x32 = x.detach().to(torch.float32)
    if block_size is None or x32.dim() != 2:
        amax = x32.abs().max() if x32.numel() else torch.tensor(0.0)
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
        return (_fp8_roundtrip(x32 / scale) * scale).to(x.dtype)
    rows, cols = x32.shape
    br, bc = ceil_div(rows, block_size), ceil_div(cols, block_size)
    padded = torch.zeros(br * block_size, bc * block_size, dtype=torch.float32)
    padded[:rows, :cols] = x32
    tiles = padded.view(br, block_size, bc, block_size)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)  # [br, 1, bc, 1]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    deq = _fp8_roundtrip(tiles / scale) * scale
    return deq.view(br * block_size, bc * block_size)[:rows, :cols].to(x.dtype).contiguous()


def to_rollout_precision(x: torch.Tensor, precision: str | None,
                         fp8_block_size: int | None = 128) -> torch.Tensor:
    """Applies one rollout precision to one tensor (non-float tensors pass through)."""
    if precision not in ROLLOUT_PRECISIONS:
        raise ValueError(
            f"rollout_precision must be one of {ROLLOUT_PRECISIONS}, got {precision!r}")
    if not x.is_floating_point() or precision in (None, "fp32"):
        return x
    if precision == "bf16":
        return round_to_bf16(x)
    return fake_quant_fp8(x, fp8_block_size)


def apply_rollout_precision(state_dict: Mapping[str, torch.Tensor], precision: str | None,
                            fp8_block_size: int | None = 128,
                            skip: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """`to_rollout_precision` over a state dict.

    Args:
        state_dict: name -> tensor.
        precision: None / "fp32" (copy), "bf16" or "fp8".
        fp8_block_size: Tile size for 2-D FP8 weights (None: per-tensor scales).
        skip: Substrings of names kept at full precision (e.g. "norm"; FP8 engines keep norms,
            embeddings and often the output layer in bf16; combine with bf16 if desired).

    Returns:
        A new dict of transformed tensors.
    """
    skip = tuple(skip)
    out = {}
    for name, tensor in state_dict.items():
        if any(s in name for s in skip):
            out[name] = tensor.detach().clone()
        else:
            out[name] = to_rollout_precision(tensor.detach(), precision, fp8_block_size)
    return out


def save_hf_safetensors(state_dict: Mapping[str, torch.Tensor], out_dir: str, *,
                        dtype: torch.dtype | None = torch.bfloat16,
                        max_shard_bytes: int = 5 * 1024**3,
                        config: Mapping | None = None,
                        metadata: Mapping[str, str] | None = None) -> str:
    """Writes a HF-style safetensors checkpoint for `/update_weights_from_disk`.

    Names must already be the HF names the engine expects (the megatron_pdm.convert mapping does
    that for Megatron models). Files are written to a temporary name and renamed, so a server
    never sees a partial shard.

    Args:
        state_dict: HF name -> tensor.
        out_dir: Directory (created). Pass it as `model_path`.
        dtype: Cast floating tensors to this dtype (None keeps them).
        max_shard_bytes: Shard size limit; several shards come with
            `model.safetensors.index.json`.
        config: Optional HF config dict written as config.json.
        metadata: Extra safetensors metadata (string -> string), e.g. the weight version.

    Returns:
        out_dir.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        tmp = os.path.join(out_dir, fname + ".tmp")
        save_file(shard, tmp, metadata=meta)
        os.replace(tmp, os.path.join(out_dir, fname))
        weight_map.update({name: fname for name in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    if config is not None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(dict(config), f, indent=1)
    logger.info("wrote %d tensors in %d shard(s) to %s", len(weight_map), len(shards), out_dir)
    return out_dir


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """Loads every `*.safetensors` file of a directory (or one file) into one state dict."""
    from safetensors.torch import load_file

    if os.path.isfile(path):
        return load_file(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """sha256 of (name, dtype, shape, the tensor's bytes)."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(name.encode("utf-8") + b"\0" + str(t.dtype).encode() + b"\0"
             + str(tuple(t.shape)).encode() + b"\0")
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Order-independent digest of (name, tensor) pairs (sha256 over the sorted per-tensor
    digests), computable while streaming: the trainer hashes what it sends, a server what it
    received, and equal digests mean bit-identical weights under identical names."""
    return combine_digests(tensor_digest(n, t) for n, t in named_tensors)


def combine_digests(tensor_digests: Iterable[str]) -> str:
    """The state digest from per-tensor `tensor_digest`s (any order), for callers that hash
    tensors one by one while streaming them elsewhere."""
    return hashlib.sha256("".join(sorted(tensor_digests)).encode()).hexdigest()
