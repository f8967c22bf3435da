"""This converter against Megatron-Bridge's own Qwen3-MoE mapping, on the tiny HF model.

Runs where Megatron-Bridge (https://github.com/NVIDIA-NeMo/Megatron-Bridge) imports: it imports
Transformer Engine unconditionally and builds its model with NCCL on a CUDA device, so on a
CPU-only machine the test is skipped. What it checks: Megatron-Bridge's
`AutoBridge.from_hf_pretrained(...).to_megatron_provider(load_weights=True)` model at TP1/PP1/EP1
(its `Qwen3MoEBridge.mapping_registry`: QKV fusion, gate/up concatenation per expert, the norm
and router names) holds the same tensors as this project's mapping (`mapping.canonical_from_hf`,
what the converter writes) for every parameter, bit for bit, except the vocabulary padding rows
of the embedding and output layer: both have the real rows `[:vocab_size]` equal, and the padded
row counts follow each tool's rule (docs/conversion.md, "Vocabulary padding, compared with
Megatron-Bridge").

API checked against Megatron-Bridge's source (src/megatron/bridge/models/conversion/
auto_bridge.py: from_hf_pretrained, to_megatron_provider; models/model_provider.py:
finalize, provide_distributed_model(wrap_with_ddp=False), which starts a one-rank NCCL group when
none is initialized; models/qwen/qwen3_moe_bridge.py: the mapping).
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch


def _auto_bridge():
    """Megatron-Bridge's AutoBridge, or None where it cannot be imported."""
    try:
        if importlib.util.find_spec("megatron.bridge") is None:
            return None
        from megatron.bridge import AutoBridge
    except Exception:  # ImportError, or Transformer Engine failing without CUDA
        return None
    return AutoBridge


AutoBridge = _auto_bridge()
pytestmark = [
    pytest.mark.skipif(AutoBridge is None,
                       reason="Megatron-Bridge not importable (needs Transformer Engine)"),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="Megatron-Bridge builds its model with NCCL on a CUDA device"),
    pytest.mark.megatron,
    pytest.mark.gpu,
]

_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
_INPUT_NORM = re.compile(r"^(decoder\.layers\.\d+\.)input_layernorm\.weight$")


def _bridge_divisor(vocab_size: int) -> int:
    """MegatronModelBridge.make_vocab_size_divisible_by: largest power of two <= 128 dividing
    the vocabulary."""
    base = 128
    while vocab_size % base:
        base //= 2
    return base


def _ours(hf_dir, grouped: bool) -> tuple[dict[str, torch.Tensor], object]:
    """This project's megatron tensors of `hf_dir` under Megatron-Bridge's (TE spec) names."""
    from megatron_pdm.arch import ModelArch
    from megatron_pdm.convert import expert_layouts, mapping
    from megatron_pdm.convert.hf_io import HFReader, read_hf_config

    arch = ModelArch.from_hf_config(read_hf_config(hf_dir))
    reader = HFReader(hf_dir)
    layout = mapping.check_hf_tensors(reader, arch)
    state = {name: mapping.canonical_from_hf(name, reader, arch, layout)
             for name in mapping.canonical_shapes(arch)}
    if grouped:  # TEGroupedMLP: experts.linear_fc1.weight{e}
        state = expert_layouts.sequential_to_grouped(state, "te")
    # TE spec: the attention input norm is fused into linear_qkv
    return {_INPUT_NORM.sub(r"\1self_attention.linear_qkv.layer_norm_weight", k): v
            for k, v in state.items()}, arch


def _bridge_state(hf_dir) -> dict[str, torch.Tensor]:
    bridge = AutoBridge.from_hf_pretrained(str(hf_dir), torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = 1
    provider.pipeline_model_parallel_size = 1
    provider.expert_model_parallel_size = 1
    provider.params_dtype = torch.float32
    provider.bf16 = False
    provider.fp16 = False
    provider.finalize()
    (model,) = provider.provide_distributed_model(wrap_with_ddp=False)
    while hasattr(model, "module"):
        model = model.module
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def test_megatron_bridge_qwen3_moe_mapping_gives_the_same_tensors(tiny_hf):
    hf_dir, _, _ = tiny_hf
    theirs = _bridge_state(hf_dir)
    grouped = any(".experts.linear_fc1.weight" in k for k in theirs)
    ours, arch = _ours(hf_dir, grouped)

    assert ours.keys() == theirs.keys(), (sorted(ours.keys() - theirs.keys()),
                                          sorted(theirs.keys() - ours.keys()))
    vocab = arch.vocab_size
    for name in _VOCAB_TENSORS:
        assert torch.equal(ours[name][:vocab], theirs[name][:vocab]), name
        assert not ours[name][vocab:].any(), f"{name}: this converter pads with zero rows"
        assert ours[name].shape[0] == arch.padded_vocab(1), name
        divisor = _bridge_divisor(vocab)
        assert theirs[name].shape[0] == -(-vocab // divisor) * divisor, (name, divisor)
    differ = [k for k in ours if k not in _VOCAB_TENSORS
              and (ours[k].shape != theirs[k].shape or not torch.equal(ours[k], theirs[k]))]
    assert not differ, differ
