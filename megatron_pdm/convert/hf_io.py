"""Streaming Hugging Face safetensors I/O: lazy per-tensor reads and a size-capped sharded writer.

A 30B checkpoint does not fit comfortably in host memory next to the model being built, so the
reader opens each `.safetensors` file with `safe_open` (memory-mapped) and materialises one tensor
(or one expert's slice of a fused expert tensor, or a row range) at a time. The writer buffers
tensors up to `max_shard_bytes`, flushes a shard, and finally renames the shards to the HF
`model-0000i-of-0000n.safetensors` pattern and writes `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFReader:
    """Lazy reader over an HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.hf_dir / SINGLE_FILE).exists():
            with safe_open(self.hf_dir / SINGLE_FILE, framework="pt") as f:
                weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.hf_dir}")
        self._file_of: dict[str, str] = dict(weight_map)
        self._handles: dict[str, object] = {}

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"tensor {name} is not in the HF checkpoint {self.hf_dir}")
        fname = self._file_of[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.hf_dir / fname, framework="pt")
        return self._handles[fname]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._handle(name).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """`tensor[index]` reading only that slice (one expert of a fused expert tensor)."""
        return self._handle(name).get_slice(name)[index]

    def close(self) -> None:
        self._handles.clear()


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    return json.loads((Path(hf_dir) / "config.json").read_text())


class ShardedSafetensorsWriter:
    """Writes tensors into size-capped safetensors shards plus the HF index json.

    Use `add(name, tensor)` in any order, then `finish()`. Memory held: at most one shard.
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._tmp_files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buffer or any(name in names for _, names in self._tmp_files):
            raise ValueError(f"tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().contiguous()
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self._tmp_files):05d}.tmp"
        save_file(self._buffer, str(path), metadata={"format": "pt"})
        self._tmp_files.append((path, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> list[str]:
        """Flush, name the shards, write the index (sharded case). Returns the file names."""
        if self._buffer:
            self._flush()
        n = len(self._tmp_files)
        if n == 0:
            raise ValueError("no tensors were written")
        weight_map, files = {}, []
        for i, (path, names) in enumerate(self._tmp_files):
            fname = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / fname)
            files.append(fname)
            weight_map.update({name: fname for name in names})
        if n > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return files


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '123' (bytes) -> bytes (decimal units, as transformers' max_shard_size)."""
    units = {
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
    }
    t = text.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)
