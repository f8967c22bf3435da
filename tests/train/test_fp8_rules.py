"""FP8 start-up rules (megatron_pdm/mcore/fp8.py) and their use by the driver.

Transformer Engine's rules (2.20): an FP8 GEMM input's leading-dim product must be a multiple of
8 (32 for mxfp8 blocks, 128 for blockwise blocks); mxfp8 needs SM 10.x/11.x; blockwise needs
SM >= 9.0 and torch CUDA >= 12.9. Before this module the trainer padded sequences to a multiple
of TP only, so s*b/TP rows were unaligned for most RL batches, and the recipe was never checked.
"""

from pathlib import Path

import pytest
import torch

from megatron_pdm.mcore import fp8
from megatron_pdm.train import model_setup as ms
from megatron_pdm.train.config import RunConfig

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml"


@pytest.mark.parametrize("recipe,align", [(None, 1), ("delayed", 8), ("tensorwise", 8),
                                          ("mxfp8", 32), ("blockwise", 128)])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("cp", [1, 2])
def test_padded_rows_are_aligned_for_every_micro_batch(recipe, align, tp, cp):
    m = fp8.seq_multiple(tp=tp, cp=cp, fp8_recipe=recipe)
    chunks = tp * (2 * cp if cp > 1 else 1)
    for s in range(1, 3 * m + 1):
        padded = -(-s // m) * m
        for b in (1, 2, 3):
            local_rows = padded * b // (tp * cp)  # sequence-parallel rank's GEMM input rows
            assert local_rows % align == 0 and padded % chunks == 0
    assert m == chunks * align  # the smallest such multiple for b = 1


def test_unknown_recipe_named():
    with pytest.raises(ValueError, match="fp8_recipe='e5m2'"):
        fp8.seq_multiple(tp=2, fp8_recipe="e5m2")


def test_driver_pads_for_fp8_alignment():
    base = RunConfig.load(str(TINY), ["parallel.tp=2"])
    assert ms.seq_multiple(base) == 2
    f = RunConfig.load(str(TINY), ["parallel.tp=2", "precision.fp8=hybrid",
                                   "precision.fp8_recipe=mxfp8"])
    assert ms.seq_multiple(f) == 64


@pytest.mark.parametrize("recipe,cap,cuda,ok", [
    ("mxfp8", (9, 0), "12.9", False),      # H100/H200
    ("mxfp8", (10, 0), "12.8", True),      # B200
    ("mxfp8", (12, 0), "12.9", False),     # TE: not yet on 12.0+
    ("blockwise", (9, 0), "12.8", False),
    ("blockwise", (9, 0), "12.9", True),
    ("blockwise", (10, 0), "13.0", True),
    ("blockwise", (8, 9), "12.9", False),
    ("tensorwise", (9, 0), "12.4", True),
    ("delayed", (8, 9), "12.1", True),
    ("delayed", (8, 9), "12.0", False),
    ("delayed", (8, 0), "12.9", False),
])
def test_recipe_support(recipe, cap, cuda, ok):
    if ok:
        fp8.check_fp8_recipe(recipe, cap, cuda)
    else:
        with pytest.raises(RuntimeError, match=f"fp8_recipe={recipe}"):
            fp8.check_fp8_recipe(recipe, cap, cuda)


def test_check_runtime_refuses_mxfp8_on_hopper():
    c = RunConfig.load(str(TINY), ["precision.fp8=e4m3", "precision.fp8_recipe=mxfp8"])
    with pytest.raises(RuntimeError, match="H100/H200 are 9.0"):
        ms.check_runtime(c, cuda=True, te=True, capability=(9, 0), torch_cuda="12.9")
    ms.check_runtime(c, cuda=True, te=True, capability=(10, 0), torch_cuda="12.9")


def test_extra_state_dropped_before_load():
    sd = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(1),
          "decoder.layers.0.self_attention.linear_qkv._extra_state": object(),
          "decoder.final_layernorm._extra_state": object()}
    assert list(fp8.drop_extra_state(sd)) == ["decoder.layers.0.self_attention.linear_qkv.weight"]
