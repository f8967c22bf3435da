"""Layout validation, memory estimate and the Qwen3-30B-A3B example scripts (pure python)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_pdm.layout import GIB, estimate_memory, format_report, param_counts, validate_layout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen3_30b_a3b"


def _arch():
    from megatron_pdm.arch import ModelArch

    return ModelArch.qwen3_30b_a3b()


def _env_defaults(script: Path) -> dict:
    text = script.read_text()
    return {k: int(v) for k, v in re.findall(r'^(\w+)="\$\{\1:-(\d+)\}"', text, re.M)}


def test_script_layouts_validate_and_fit():
    arch = _arch()
    for script in ("train_pdm.sh", "train_pdm_fp8.sh"):
        env = _env_defaults(EXAMPLE / "train_pdm.sh")  # the fp8 script is its wrapper
        world = env["NNODES"] * env["GPUS_PER_NODE"]
        layout = validate_layout(arch, world_size=world, tp=env["TP"], pp=env["PP"], ep=env["EP"])
        assert layout.sequence_parallel and layout.dp == world // (env["TP"] * env["PP"])
        assert layout.padded_vocab_size == 152064  # 151936 -> multiple of 128*4
        est = estimate_memory(
            arch,
            layout,
            micro_batch_size=1,
            seq_length=8192,
            recompute="full",
            fp8=script.endswith("fp8.sh"),
        )
        report = format_report(arch, layout, est, gpu_memory_gib=80)
        assert "fits in 80 GiB" in report and "padded to 152064" in report
        assert 30 * GIB < est.total < 70 * GIB


def test_param_count_is_qwen3_30b_a3b():
    arch = _arch()
    layout = validate_layout(arch, world_size=1, tp=1, pp=1, ep=1)
    dense, expert = param_counts(arch, layout)
    assert 30.4e9 < dense + expert < 30.6e9  # 30.5B total
    assert expert == 48 * 128 * 3 * 768 * 2048


def test_memory_terms_follow_the_layout():
    arch = _arch()
    base = validate_layout(arch, world_size=16, tp=4, pp=1, ep=8)
    e1 = estimate_memory(arch, base, micro_batch_size=1, seq_length=4096)
    e2 = estimate_memory(
        arch,
        validate_layout(arch, world_size=32, tp=4, pp=1, ep=8),
        micro_batch_size=1,
        seq_length=4096,
    )
    assert e2.weights == e1.weights and e2.optimizer < e1.optimizer  # more DP shards Adam
    full = estimate_memory(arch, base, micro_batch_size=1, seq_length=4096, recompute="full")
    assert full.activations < e1.activations
    nodist = estimate_memory(
        arch, base, micro_batch_size=1, seq_length=4096, distributed_optimizer=False
    )
    assert nodist.optimizer == (e1.dense_params + e1.expert_params) * 12
    fp8 = estimate_memory(arch, base, micro_batch_size=1, seq_length=4096, fp8=True)
    assert fp8.weights > e1.weights


def test_fused_head_logits_term_is_one_chunk_flat_in_the_vocabulary():
    import dataclasses

    arch = _arch()
    lay = validate_layout(arch, world_size=16, tp=4, pp=1, ep=8)
    big = validate_layout(dataclasses.replace(arch, vocab_size=4 * arch.vocab_size),
                          world_size=16, tp=4, pp=1, ep=8)
    kw = dict(micro_batch_size=2, seq_length=8192)
    plain = estimate_memory(arch, lay, **kw)
    assert plain.logits == 2 * 16384 * (lay.padded_vocab_size // 4) * 4
    fused = estimate_memory(arch, lay, fused_head_chunk=(1024, 4096), **kw)
    assert fused.logits == 2 * 1024 * 4096 * 4 < plain.logits
    assert estimate_memory(arch, big, fused_head_chunk=(1024, 4096), **kw).logits == fused.logits
    assert estimate_memory(arch, big, **kw).logits > plain.logits
    tiny = estimate_memory(arch, lay, micro_batch_size=1, seq_length=64,
                           fused_head_chunk=(1024, 4096))
    assert tiny.logits == 2 * 64 * 4096 * 4  # never more than the logits themselves


def test_bad_layouts_list_every_problem():
    arch = _arch()
    with pytest.raises(ValueError) as err:
        validate_layout(arch, world_size=12, tp=8, pp=5, ep=6, sequence_parallel=False)
    msg = str(err.value)
    for part in (
        "world_size=12 is not divisible by TP*PP*CP=40",
        "num_experts=128 is not divisible by EP=6",
        "num_query_groups=4 is not divisible by TP=8",
        "num_layers=48 is not divisible by PP=5",
        "requires sequence_parallel",
    ):
        assert part in msg, part
    with pytest.raises(ValueError, match="EP\\*ETP=8 does not divide TP\\*CP\\*DP=4"):
        validate_layout(arch, world_size=4, tp=4, pp=1, ep=8)
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        validate_layout(arch, world_size=4, tp=0, pp=1, ep=1)


def test_model_sh_matches_qwen3_30b_a3b():
    """model.sh reads its flags from megatron_pdm/arch.py (it restated them before)."""
    import os
    import subprocess
    import sys

    arch = _arch()
    assert "--num-layers" not in (EXAMPLE / "model.sh").read_text()  # not restated
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    text = subprocess.run(["bash", "-c", f'source "{EXAMPLE / "model.sh"}"; '
                           'printf "%s\\n" "${MODEL_ARGS[@]}"'], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout
    tokens = text.split()
    flags = {t[2:]: tokens[i + 1] for i, t in enumerate(tokens[:-1])
             if t.startswith("--") and not tokens[i + 1].startswith("--")}
    want = {
        "num-layers": arch.num_layers,
        "hidden-size": arch.hidden_size,
        "num-attention-heads": arch.num_attention_heads,
        "num-query-groups": arch.num_query_groups,
        "kv-channels": arch.head_dim,
        "num-experts": arch.num_experts,
        "moe-router-topk": arch.moe_router_topk,
        "moe-ffn-hidden-size": arch.moe_ffn_hidden_size,
        "vocab-size": arch.vocab_size,
        "rotary-base": arch.rotary_base,
        "norm-epsilon": arch.norm_epsilon,
        "max-position-embeddings": arch.max_position_embeddings,
        "make-vocab-size-divisible-by": arch.make_vocab_size_divisible_by,
    }
    for flag, value in want.items():
        assert float(flags[flag]) == float(value), flag
    for switch in ("--qk-layernorm", "--swiglu", "--untie-embeddings-and-output-weights"):
        assert switch in tokens, switch


def test_fp8_script_is_train_pdm_with_precision_fp8():
    """One script, two precisions: train_pdm_fp8.sh only runs train_pdm.sh with PRECISION=fp8
    (its comments are its own header); train_pdm.sh selects PRECISION_ARGS by PRECISION."""
    wrapper = (EXAMPLE / "train_pdm_fp8.sh").read_text().splitlines()
    assert [line for line in wrapper if line.strip() and not line.startswith("#")] == [
        'PRECISION=fp8 exec bash "$(dirname "$0")/train_pdm.sh" "$@"']
    script = (EXAMPLE / "train_pdm.sh").read_text()
    assert 'PRECISION="${PRECISION:-bf16}"' in script
    fp8 = re.search(r"^    fp8\) PRECISION_ARGS=\(\n(.*?)^    \) ;;$", script, re.S | re.M).group(1)
    assert "precision.fp8=e4m3" in fp8 and "rollout.rollout_precision=fp8" in fp8
    assert script.count("PRECISION_ARGS=(") == 2  # bf16 and fp8, nothing else chosen twice


def test_pdm_yaml_matches_driver_schema_and_arch():
    """pdm.yaml loads in the driver's schema; its architecture is not restated there but passed by
    the scripts from megatron_pdm/arch.py (tests/train/test_driver_config.py checks the resolved
    model against the preset)."""
    config = pytest.importorskip("megatron_pdm.train.config")
    cfg = config.RunConfig.load(str(EXAMPLE / "pdm.yaml"))
    assert cfg.parallel.tp == 4 and cfg.parallel.ep == 8
    assert cfg.loss.name == "pdm-agg"
