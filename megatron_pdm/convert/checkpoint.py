"""HF Qwen3-MoE / dense Qwen3 / Llama -> megatron-core dist checkpoint (torch_dist), and loading it at any layout.

Import, on every rank of the requested (TP, EP, PP) layout:
1. build this rank's local GPTModel (`megatron_pdm.mcore.model.build_model`);
2. for each local parameter, name its canonical full tensor (global layer, global expert), read
   just that tensor from the safetensors files (`mapping.canonical_from_hf`; embedding and output
   rows are read as a row range) and cut this rank's TP / expert-TP part;
3. `dist_checkpointing.save(model.sharded_state_dict(), out)`.
A dist checkpoint describes every tensor by its global shape, so it loads at any other TP/EP/PP
(`load_model`) - except for the vocabulary padding, which megatron ties to TP (see
`check_vocab_padding`).

The output directory is Megatron-LM's `--load` layout (`load_dir.py`): the dist checkpoint in
`<out>/release/`, the tracker `<out>/latest_checkpointed_iteration.txt` ("release", written last,
so an interrupted import is never taken for a checkpoint), and beside them `pdm_model.json`
(the architecture (`ModelArch.to_dict`), the source HF expert layout and dtype, the layout used
at import, the key style and the source HF config, so the exporter and the trainer can rebuild
the model) and `hf_assets/`.

Key styles: megatron's local spec stores the pre-MLP norm as `mlp.linear_fc1.layer_norm_weight`,
its Transformer Engine MoE spec as `pre_mlp_layernorm.weight`; `rename_for_key_style` maps one onto
the other so a checkpoint written on CPU with the local spec loads into the TE model on GPUs.
A dense layer's pre-MLP norm has one key in both specs (`mlp.linear_fc1.layer_norm_weight`: TE
fuses it into linear_fc1, the local spec maps its separate norm onto that key), so for dense models
the key style changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pdm.arch import ModelArch
from megatron_pdm.convert import load_dir as layout_dir
from megatron_pdm.convert import mapping, sharding
from megatron_pdm.convert.hf_io import HFReader, read_hf_config

META_FILE = layout_dir.META_FILE  # re-exported: importers of checkpoint.META_FILE keep working
KEY_STYLES = ("local", "te")
_PRE_MLP_KEYS = {
    "local": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    "te": "decoder.layers.pre_mlp_layernorm.weight",
}
_DENSE_FC1_KEY = "decoder.layers.mlp.linear_fc1.weight"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ST_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------


def read_meta(megatron_dir) -> dict:
    path = layout_dir.meta_dir(megatron_dir) / META_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} missing: not a checkpoint written by convert_hf_to_megatron"
        )
    return json.loads(path.read_text())


def pre_mlp_key(arch, key_style: str) -> str:
    """Dist-checkpoint key of the pre-MLP norm: by key style for MoE, the one key for dense."""
    return _PRE_MLP_KEYS[key_style if arch.is_moe else "local"]


def arch_from_meta(meta: dict) -> ModelArch:
    return ModelArch.from_dict(meta["arch"], path="pdm_model.json arch")


def check_vocab_padding(arch, ckpt_tp: int, tp: int) -> None:
    """megatron pads the vocabulary to a multiple of divisible_by * TP: refuse a mismatch early."""
    saved, wanted = arch.padded_vocab(ckpt_tp), arch.padded_vocab(tp)
    if saved != wanted:
        raise ValueError(
            f"vocab padding differs: checkpoint written at TP={ckpt_tp} has {saved} rows, TP={tp} "
            f"needs {wanted}; re-import at TP={tp} or pick make_vocab_size_divisible_by so "
            "both agree"
        )


# ---------------------------------------------------------------------------------------------
# model at a layout
# ---------------------------------------------------------------------------------------------


def build_local_model(arch, *, tp: int, ep: int, pp: int, params_dtype=torch.float32):
    """This rank's GPTModel for the layout (parallel_state must be initialised)."""
    from megatron.core import parallel_state as ps

    from megatron_pdm.mcore.cpu_shim import apply_cpu_shim
    from megatron_pdm.mcore.model import build_model, transformer_config

    apply_cpu_shim()
    config = transformer_config(
        arch, tp=tp, pp=pp, ep=ep, params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16
    )
    return build_model(
        arch,
        config,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
    )


def canonical_name(model, local_name: str) -> str:
    """Local parameter name of this rank -> canonical (global layer, global expert) name."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    return sharding.canonical_name(model, local_name,
                                   experts_per_rank=(model.config.num_moe_experts or 0) // ep,
                                   ep_rank=ps.get_expert_model_parallel_rank())


def shard_of(name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full canonical tensor `name` (`sharding.RULES`: TP dense,
    expert-TP experts)."""
    from megatron.core import parallel_state as ps

    rule = sharding.rule_for(name)
    if rule.group == "etp":
        count, index = (ps.get_expert_tensor_parallel_world_size(),
                        ps.get_expert_tensor_parallel_rank())
    else:
        count, index = (ps.get_tensor_model_parallel_world_size(),
                        ps.get_tensor_model_parallel_rank())
    return sharding.shard(full, rule.split, index, count)


def _vocab_rows(reader: HFReader, hf_name: str, arch, local_rows: int) -> torch.Tensor:
    """Rows [r*V_local, (r+1)*V_local) of the padded vocabulary matrix, reading only those rows."""
    from megatron.core import parallel_state as ps

    start = ps.get_tensor_model_parallel_rank() * local_rows
    stop = min(start + local_rows, arch.vocab_size)
    rows = reader._handle(hf_name).get_slice(hf_name)[start:stop] if stop > start else None
    if rows is None:
        return torch.zeros(
            local_rows, arch.hidden_size, dtype=_DTYPES[_ST_DTYPES[reader.dtype(hf_name)]]
        )
    return mapping.pad_vocab_rows(rows, local_rows)


def fill_from_hf(model, reader: HFReader, arch, expert_layout: str, progress: bool) -> int:
    """Copy every local parameter of `model` from the HF checkpoint. Returns the tensor count."""
    from tqdm import tqdm

    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    count = 0
    for local_name, param in tqdm(state.items(), desc="import", disable=not progress, unit="t"):
        name = canonical_name(model, local_name)
        if name == "embedding.word_embeddings.weight":
            part = _vocab_rows(reader, "model.embed_tokens.weight", arch, param.shape[0])
        elif name == "output_layer.weight":
            # tied + PP > 1: the last stage's copy of the embedding is read from the embedding
            part = _vocab_rows(reader, mapping.hf_output_name(arch), arch, param.shape[0])
        else:
            try:
                part = shard_of(name, mapping.canonical_from_hf(name, reader, arch, expert_layout))
            except KeyError as exc:
                raise ValueError(f"no HF source for megatron tensor {local_name} ({name}): {exc}")
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(
                f"shape mismatch for megatron tensor {local_name} ({name}): HF gives "
                f"{tuple(part.shape)}, the model at this layout has {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(part.to(param.dtype))
        count += 1
    return count


def rename_for_key_style(sharded_sd: dict, from_style: str, to_style: str) -> dict:
    """Rename the pre-MLP-norm ShardedTensor key between the local and TE spec styles (in place).

    A dense model (its state holds the dense `decoder.layers.mlp.linear_fc1.weight`) has the same
    key in both styles: nothing is renamed."""
    for style in (from_style, to_style):
        if style not in KEY_STYLES:
            raise ValueError(f"key style must be one of {KEY_STYLES}, got {style!r}")
    keys = {getattr(value, "key", None) for value in sharded_sd.values()}
    if from_style == to_style or _DENSE_FC1_KEY in keys:
        return sharded_sd
    src, dst = _PRE_MLP_KEYS[from_style], _PRE_MLP_KEYS[to_style]
    for value in sharded_sd.values():
        if getattr(value, "key", None) == src:
            value.key = dst
    return sharded_sd


# ---------------------------------------------------------------------------------------------
# import / load
# ---------------------------------------------------------------------------------------------


def import_rank(
    hf_dir: str, out_dir: str, tp: int, ep: int, pp: int, dtype: str, key_style: str
) -> None:
    """One rank of the HF -> dist-checkpoint import (the process group must exist)."""
    from megatron_pdm.convert.distributed import init_model_parallel, is_rank0

    hf_cfg = read_hf_config(hf_dir)
    arch = ModelArch.from_hf_config(hf_cfg)
    reader = HFReader(hf_dir)
    expert_layout = mapping.check_hf_tensors(reader, arch)
    src_dtype = _ST_DTYPES.get(reader.dtype("model.embed_tokens.weight"), "fp32")
    dtype = src_dtype if dtype == "auto" else dtype
    init_model_parallel(tp, ep, pp)
    model = build_local_model(arch, tp=tp, ep=ep, pp=pp, params_dtype=_DTYPES[dtype])
    fill_from_hf(model, reader, arch, expert_layout, progress=is_rank0())
    reader.close()
    meta = {
        "format": "megatron-core dist_checkpointing torch_dist",
        "arch": arch.to_dict(),
        "layout_at_import": {"tp": tp, "ep": ep, "pp": pp, "etp": 1},
        "params_dtype": dtype,
        "key_style": key_style,
        "source": {"hf_dir": str(hf_dir), "expert_layout": expert_layout, "dtype": src_dtype},
        "hf_config": hf_cfg,
    }
    save_release(model, out_dir, meta, key_style=key_style)
    if is_rank0():
        _copy_hf_assets(Path(hf_dir), Path(out_dir) / "hf_assets")


def save_release(model, out_dir: str, meta: dict, *, key_style: str = "local",
                 model_style: str = "local") -> None:
    """Collective: `model` (built with the `model_style` spec) as a Megatron-LM release
    checkpoint in `out_dir` (load_dir.py layout) with the `key_style` names and `meta` as its
    pdm_model.json; the tracker comes last."""
    from megatron.core import dist_checkpointing

    from megatron_pdm.convert.distributed import is_rank0

    out = Path(out_dir)
    target = layout_dir.release_dir(out)
    if is_rank0():
        (out / layout_dir.TRACKER_FILE).unlink(missing_ok=True)  # until this save completes
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded = rename_for_key_style(model.sharded_state_dict(), model_style, key_style)
    dist_checkpointing.save(sharded, str(target))
    dist.barrier()
    if is_rank0():
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        layout_dir.write_tracker(out)
    dist.barrier()


def _copy_hf_assets(hf_dir: Path, dst: Path) -> None:
    """Tokenizer and generation config travel with the checkpoint (export writes them back)."""
    import shutil

    names = [
        p
        for p in hf_dir.iterdir()
        if p.is_file()
        and not p.name.endswith(".safetensors")
        and p.name not in ("config.json", "model.safetensors.index.json")
    ]
    if names:
        dst.mkdir(exist_ok=True)
        for p in names:
            shutil.copy2(p, dst / p.name)


def load_model(megatron_dir: str, *, tp: int, ep: int, pp: int, key_style: str = "local"):
    """Build this rank's model at (tp, ep, pp) and load the dist checkpoint into it.

    `key_style` is the style of the model being loaded into (`local` for the CPU/local spec).
    parallel_state must be initialised for the layout. Returns (model, arch, meta).
    """
    from megatron.core import dist_checkpointing

    meta = read_meta(megatron_dir)
    arch = arch_from_meta(meta)
    check_vocab_padding(arch, meta["layout_at_import"]["tp"], tp)
    model = build_local_model(arch, tp=tp, ep=ep, pp=pp, params_dtype=_DTYPES[meta["params_dtype"]])
    sharded = rename_for_key_style(model.sharded_state_dict(), key_style, meta["key_style"])
    state = dist_checkpointing.load(sharded, layout_dir.weights_dir(megatron_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"checkpoint/model mismatch: missing={missing} unexpected={unexpected}")
    return model, arch, meta


def megatron_logits_rank(megatron_dir: str, tp: int, ep: int, ids_path: str, out_path: str) -> None:
    """One rank of a verification forward: load at (tp, ep), gather logits over TP, rank 0 saves
    `[B, S, V]` (padding stripped) for the token ids saved at `ids_path`."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_pdm.convert.distributed import init_model_parallel

    init_model_parallel(tp, ep, 1)
    model, arch, _ = load_model(megatron_dir, tp=tp, ep=ep, pp=1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)  # dropout is 0; the attention code forks the tracker
    model.eval()
    ids_bs = torch.load(ids_path)
    b, s = ids_bs.shape
    pos_bs = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        local_bsv = model(ids_bs, pos_bs, mask).float()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local_bsv) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local_bsv.contiguous(), group=group)
    if dist.get_rank() == 0:
        torch.save(torch.cat(parts, dim=-1)[..., : arch.vocab_size], out_path)
