"""The layer spec follows Transformer Engine's presence (BF16 too), and the memory estimate the spec.

TE is absent here: `have_transformer_engine` is replaced by a stand-in that says it is importable.
"""

import pathlib

import pytest

from megatron_pdm.arch import ModelArch
from megatron_pdm.layout import GIB, estimate_memory, format_report, validate_layout
from megatron_pdm.train import model_setup as ms
from megatron_pdm.train.config import RunConfig

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml")


@pytest.mark.parametrize("te", [True, False])
@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_te_spec_whenever_te_is_importable(monkeypatch, te, fp8):
    monkeypatch.setattr(ms, "have_transformer_engine", lambda: te)
    cfg = RunConfig.load(TINY, ["precision.params_dtype=bf16"]
                         + ([f"precision.fp8={fp8}"] if fp8 else []))
    assert ms.use_te(cfg) is (te or fp8 is not None)
    assert ms.key_style(cfg) == ("te" if te or fp8 else "local")


def test_local_spec_estimate_adds_the_attention_scores():
    arch = ModelArch.qwen3_30b_a3b()
    lay = validate_layout(arch, world_size=8, tp=4, pp=1, ep=8)
    kw = dict(micro_batch_size=2, seq_length=8192, recompute="full")
    fused = estimate_memory(arch, lay, **kw)
    local = estimate_memory(arch, lay, attention="local", **kw)
    elems = 2 * (32 // 4) * 8192 ** 2  # [b, heads per TP rank, s, s]
    assert fused.attention_scores == 0
    assert local.attention_scores == 12 * elems  # one layer kept (recompute) + its transient
    assert local.total - fused.total == 12 * elems and 11 * GIB < 12 * elems < 13 * GIB
    assert "attn scores" in format_report(arch, lay, local)
    assert "attn scores" not in format_report(arch, lay, fused)
    kept = estimate_memory(arch, lay, attention="local", micro_batch_size=2, seq_length=8192)
    assert kept.attention_scores == 6 * elems * arch.num_layers + 6 * elems  # no recompute
    with pytest.raises(ValueError, match="fused|local"):
        estimate_memory(arch, lay, attention="flash", **kw)


@pytest.mark.parametrize("te", [True, False])
def test_dry_run_estimates_the_spec_it_would_build(monkeypatch, capsys, te):
    from megatron_pdm.train.dry_run import dry_run

    monkeypatch.setattr(ms, "have_transformer_engine", lambda: te)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dry_run(RunConfig.load(TINY)) == 0
    out = capsys.readouterr().out
    assert ("attn scores" in out) is (not te)
    assert ("layer spec: transformer-engine" in out) is te
