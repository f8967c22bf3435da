"""Live export: the sharded megatron model's weights gathered as HF tensors on rank 0, no disk.

The model is filled from a tiny random HF Qwen3-MoE at TP2, EP2, TP2xEP2 (world 2 each; ETP 1)
and PP2, then `gather_hf_state_dict` must give back every HF tensor bit-exactly (fp32), with the
vocabulary padding stripped; a bf16 export equals the HF tensors cast to bf16. Names of the
Transformer Engine layer spec map onto the same canonical names (checked without TE).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_pdm.convert.live import canonical_local_name
from tests.support._dist import run_gloo

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _worker(rank, world, hf_dir, tp, ep, pp, out_path):
    from megatron_pdm.arch import ModelArch
    from megatron_pdm.convert.checkpoint import build_local_model, fill_from_hf
    from megatron_pdm.convert.hf_io import HFReader, read_hf_config
    from megatron_pdm.convert.live import gather_hf_state_dict, iter_hf_groups
    from megatron_pdm.convert.mapping import check_hf_tensors
    from megatron_pdm.mcore.parallel import init_model_parallel

    init_model_parallel(tp, ep, pp)
    arch = ModelArch.from_hf_config(read_hf_config(hf_dir))
    reader = HFReader(hf_dir)
    model = build_local_model(arch, tp=tp, ep=ep, pp=pp)
    fill_from_hf(model, reader, arch, check_hf_tensors(reader, arch), progress=False)
    state = gather_hf_state_dict(model, arch)
    bf16 = gather_hf_state_dict(model, arch, dtype=torch.bfloat16)
    labels = [label for label, _ in iter_hf_groups(model, arch)]
    assert labels[0] == "embeddings" and labels[-1] == "head" and len(labels) == 2 + 2
    if rank == 0:
        torch.save({"fp32": state, "bf16": bf16}, out_path)
    else:
        assert state == {} and bf16 == {}


@pytest.mark.gloo
@pytest.mark.parametrize("tp,ep,pp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)],
                         ids=["tp2", "ep2", "tp2ep2", "pp2"])
def test_live_export_equals_the_hf_checkpoint(tiny_hf, tmp_path, tp, ep, pp):
    hf_dir, _, _ = tiny_hf
    run_gloo(_worker, 2, str(hf_dir), tp, ep, pp, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    want = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        want.update(load_file(str(f)))
    assert set(got["fp32"]) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got["fp32"][name], tensor), name
        assert torch.equal(got["bf16"][name], tensor.to(torch.bfloat16)), name


def test_te_spec_names_map_to_local_names():
    assert canonical_local_name("decoder.layers.3.mlp.experts.linear_fc1.weight7") == \
        "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"
    assert canonical_local_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") \
        == "decoder.layers.0.input_layernorm.weight"
    name = "decoder.layers.1.mlp.router.weight"
    assert canonical_local_name(name) == name
