"""A converted (local-spec) checkpoint loads into a model whose modules carry `_extra_state`.

Transformer Engine modules put an `_extra_state` entry (FP8 scaling metadata) into their sharded
state dict; the converter writes a local-spec model. Its megatron linears write an (empty)
`_extra_state` too, so those keys exist; its norms are torch RMSNorm and write none, while TE's
norms (and fused norm+linear layers) do. Stand-in: the model's RMSNorm modules given TE's
get_extra_state/set_extra_state (megatron turns the entry into a ShardedObject, as for TE). On megatron-core's dist-checkpoint load the stand-in model
reproduces the refusal ("Missing key in checkpoint state_dict: ..._extra_state/shard_0_1"), and
the driver's load (train/model_setup.load_initial_weights) loads the same checkpoint, every
weight equal to the converter's, with no extra state set (TE starts its FP8 metadata afresh).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.support._dist import run_gloo


def _worker(rank, world, hf_dir, out_dir):
    from megatron.core import dist_checkpointing

    from megatron_pdm.convert import checkpoint as conv
    from megatron_pdm.convert.load_dir import weights_dir
    from megatron_pdm.mcore.cpu_shim import apply_cpu_shim
    from megatron_pdm.train import model_setup as ms

    apply_cpu_shim()
    conv.import_rank(hf_dir, out_dir, 1, 1, 1, "auto", "local")  # the converter's checkpoint
    reference, arch, meta = conv.load_model(out_dir, tp=1, ep=1, pp=1)
    set_calls = []
    # TE's norms carry extra state (FP8 metadata of TE ops); the local spec's torch RMSNorm has
    # none (megatron's local linears already write an empty `_extra_state`: those load)
    te_norm = type("TENormStandIn", (torch.nn.RMSNorm,), {
        "get_extra_state": lambda self: torch.zeros(4, dtype=torch.uint8),
        "set_extra_state": lambda self, state: set_calls.append(state)})
    model = conv.build_local_model(arch, tp=1, ep=1, pp=1,
                                   params_dtype=next(reference.parameters()).dtype)
    for m in model.modules():
        if type(m) is torch.nn.RMSNorm:
            m.__class__ = te_norm
    sharded = model.sharded_state_dict()
    extra = [k for k in sharded if k.endswith("_extra_state")]
    assert extra, "the stand-in modules put no _extra_state into the sharded state dict"
    try:
        dist_checkpointing.load(sharded, weights_dir(out_dir))  # the refusal, reproduced
        refusal = "loaded"
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException; its message
        refusal = str(err)
    assert re.search(r"Missing key in checkpoint state_dict: \S+_extra_state/shard_\d+_\d+",
                     refusal), refusal
    ms.load_initial_weights(model, out_dir, meta, tp=1, style="local")
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name]), name
    assert not set_calls


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.slow
def test_converted_checkpoint_loads_into_a_model_with_extra_state(tiny_hf, tmp_path):
    hf_dir, _, _ = tiny_hf
    run_gloo(_worker, 1, str(hf_dir), str(tmp_path / "mcore"))
