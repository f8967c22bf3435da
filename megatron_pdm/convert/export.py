"""megatron-core dist checkpoint -> HF safetensors (Qwen3-MoE, dense Qwen3, Llama), streamed one
layer at a time.

The dist checkpoint stores every tensor by global shape with the layers stacked on a leading axis
(`decoder.layers.self_attention.linear_qkv.weight [L, (nh+2g)D, H]`, experts additionally on an
expert axis: `decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2I, H]`; a dense MLP's
`decoder.layers.mlp.linear_fc1.weight [L, 2F, H]` is [gate; up] whatever the TP it was written at). The torch_dist
format is a torch.distributed.checkpoint directory, so the exporter asks DCP for exactly one
layer's slice of each key at a time (`_SliceLoadPlanner`, one process, no process group), so
the layout the checkpoint was written at does not matter, no model is allocated, and host memory
holds one layer plus one output shard.
The vocabulary padding is stripped, q/k/v are split out of the fused projection and experts are
written in the HF layout requested (default: the layout of the HF checkpoint that was imported).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megatron_pdm.arch import ModelArch
from megatron_pdm.convert import mapping
from megatron_pdm.convert.checkpoint import _DTYPES, arch_from_meta, pre_mlp_key, read_meta
from megatron_pdm.convert.load_dir import meta_dir, weights_dir
from megatron_pdm.convert.hf_io import ShardedSafetensorsWriter

_EXPERT_KEYS = {
    "linear_fc1": "decoder.layers.mlp.experts.experts.linear_fc1.weight",
    "linear_fc2": "decoder.layers.mlp.experts.experts.linear_fc2.weight",
}


def dist_key(rest: str, key_style: str, arch) -> str:
    """Dist-checkpoint key of a per-layer canonical suffix (non-expert)."""
    if rest == "input_layernorm.weight":
        return "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    if rest == "pre_mlp_layernorm.weight":
        return pre_mlp_key(arch, key_style)
    return "decoder.layers." + rest


class _SliceLoadPlanner:
    """torch DCP load planner reading one hyper-rectangle of each requested tensor.

    megatron's torch_dist format is a torch.distributed.checkpoint directory whose keys are the
    ShardedTensor keys with global shapes. `requests` maps key -> (offsets, destination tensor
    of the
    slice shape); only the overlapping stored chunks are read (DCP's own resharding helper).
    """

    def __new__(cls, requests: dict):
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        class Planner(DefaultLoadPlanner):
            def create_local_plan(self):
                items = []
                for key, (offsets, dest) in requests.items():
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
                    items += create_read_items_for_chunk_list(
                        key, self.metadata.state_dict_metadata[key], [chunk]
                    )
                return LoadPlan(items)

            def lookup_tensor(self, index):
                # the destination is a plain tensor holding just the slice: read items carry
                # offsets relative to it (dest_offsets), so no shard lookup by global offset
                return requests[index.fqn][1]

        return Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


def read_metadata(ckpt_dir: str) -> dict:
    """key -> (global shape, dtype) of every tensor in a torch_dist checkpoint (reads .metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(ckpt_dir).read_metadata()
    return {
        k: (tuple(v.size), v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def _load_slices(ckpt_dir: str, requests: dict) -> None:
    import torch.distributed.checkpoint as dcp

    state = {key: dest for key, (_, dest) in requests.items()}
    dcp.load(
        state,
        storage_reader=dcp.FileSystemReader(ckpt_dir),
        planner=_SliceLoadPlanner(requests),
        no_dist=True,
    )


def _load_group(
    ckpt_dir: str, names: list[str], arch, key_style: str, metadata: dict
) -> dict[str, torch.Tensor]:
    """Full canonical tensors for `names` (one `mapping.hf_group_names` group of one layer)."""
    requests: dict[str, tuple] = {}
    where: dict[str, tuple] = {}  # canonical name -> (dist key, index into the loaded slice)
    for name in names:
        if not name.startswith("decoder.layers."):
            shape, dtype = _meta(metadata, name)
            requests[name] = ((0,) * len(shape), torch.empty(shape, dtype=dtype))
            where[name] = (name, ())
            continue
        layer_str, rest = name[len("decoder.layers.") :].split(".", 1)
        layer = int(layer_str)
        if rest.startswith("mlp.experts.local_experts."):
            parts = rest.split(".")
            key, index = _EXPERT_KEYS[parts[4]], (0, int(parts[3]))
        else:
            key, index = dist_key(rest, key_style, arch), (0,)
        if key not in requests:
            shape, dtype = _meta(metadata, key)
            offsets = (layer,) + (0,) * (len(shape) - 1)
            requests[key] = (offsets, torch.empty((1,) + shape[1:], dtype=dtype))
        where[name] = (key, index)
    _load_slices(ckpt_dir, requests)
    return {name: requests[key][1][index] for name, (key, index) in where.items()}


def _meta(metadata: dict, key: str):
    if key not in metadata:
        raise ValueError(f"tensor {key} is missing from the megatron checkpoint")
    return metadata[key]


def _check_checkpoint_shapes(metadata: dict, arch, key_style: str) -> None:
    """Refuse a checkpoint whose stored tensors do not match the recorded architecture."""
    want = {}
    layers = arch.num_layers
    for name, shape in mapping.canonical_shapes(arch).items():
        if name.startswith("decoder.layers."):
            rest = name.split(".", 3)[3]
            if rest.startswith("mlp.experts.local_experts."):
                fc = rest.split(".")[4]
                want[_EXPERT_KEYS[fc]] = (layers, arch.num_experts, *shape)
            else:
                want[dist_key(rest, key_style, arch)] = (layers, *shape)
        elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            want[name] = None  # padded rows depend on the TP used at import; checked below
        else:
            want[name] = shape
    problems = [f"missing tensor {k}" for k in want if k not in metadata]
    extra = [k for k in metadata if k not in want and not k.endswith("_extra_state")]
    problems += [f"unexpected tensor {k}" for k in extra]
    for k, shape in want.items():
        if k not in metadata:
            continue
        have = tuple(metadata[k][0])
        if shape is None:
            ok = have[1:] == (arch.hidden_size,) and have[0] >= arch.vocab_size
        else:
            ok = have == tuple(shape)
        if not ok:
            problems.append(
                f"tensor {k} has shape {have}, expected {shape or ('>=V', arch.hidden_size)}"
            )
    if problems:
        raise ValueError(
            "megatron checkpoint does not match its pdm_model.json:\n  " + "\n  ".join(problems)
        )


def export_to_hf(
    megatron_dir: str,
    out_dir: str,
    *,
    expert_layout: str = "source",
    dtype: str = "source",
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = True,
) -> dict:
    """Write the HF checkpoint (single process, no process group needed).

    Returns a summary dict (files, tensors, bytes).
    """
    from tqdm import tqdm

    meta = read_meta(megatron_dir)
    arch = arch_from_meta(meta)
    key_style = meta["key_style"]
    if expert_layout == "source":
        expert_layout = meta["source"]["expert_layout"]
    if dtype == "source":
        dtype = meta["source"]["dtype"]
    torch_dtype = _DTYPES[dtype]
    assets = meta_dir(megatron_dir) / "hf_assets"
    megatron_dir = weights_dir(megatron_dir)  # Megatron-LM layout (release/) or a flat checkpoint
    metadata = read_metadata(megatron_dir)
    _check_checkpoint_shapes(metadata, arch, key_style)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardedSafetensorsWriter(out, max_shard_bytes)
    expected = mapping.hf_shapes(arch, expert_layout)
    written = 0
    groups = list(mapping.hf_group_names(arch))
    for _, names in tqdm(groups, desc="export", disable=not progress, unit="group"):
        full = _load_group(megatron_dir, names, arch, key_style, metadata)
        for hf_name, t in mapping.hf_from_canonical(full, arch, expert_layout).items():
            if tuple(t.shape) != expected.get(hf_name):
                raise ValueError(
                    f"export produced {hf_name} {tuple(t.shape)}, expected {expected.get(hf_name)}"
                )
            writer.add(hf_name, t.to(torch_dtype))
            written += 1
        del full
    if written != len(expected):
        raise ValueError(f"export wrote {written} tensors, the architecture has {len(expected)}")
    files = writer.finish()
    _write_config(meta, arch, out, dtype)
    if assets.is_dir():
        for p in assets.iterdir():
            shutil.copy2(p, out / p.name)
    return {
        "files": files,
        "tensors": written,
        "bytes": writer.total_bytes,
        "expert_layout": expert_layout,
        "dtype": dtype,
    }


def _write_config(meta: dict, arch, out: Path, dtype: str) -> None:
    """The imported config.json (arch re-checked against pdm_model.json), else a fresh one."""
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    cfg = dict(meta.get("hf_config") or {})
    if not cfg or _arch_mismatch(cfg, arch):
        cfg = hf_config_from_arch(arch)
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = names[dtype]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _arch_mismatch(cfg: dict, arch: ModelArch) -> bool:
    try:
        theirs = ModelArch.from_hf_config(
            cfg, make_vocab_size_divisible_by=arch.make_vocab_size_divisible_by)
    except (ValueError, KeyError):
        return True
    return bool(arch.differences(theirs))


def hf_config_from_arch(arch: ModelArch) -> dict:
    """The transformers config dict of `arch`'s family (`ModelArch.to_hf_config`)."""
    return arch.to_hf_config()
