"""The trainer on a dense, tied-embedding model loaded from a converted checkpoint.

A tiny random Llama (tied embeddings, no q/k norm; `convert/tiny.py`) is imported at TP 2; the
driver runs the tiny demo's addition task on it at TP 2 (local engine), its `model` section
naming the dense architecture (the `sets` printed by `python -m megatron_pdm.arch`'s printer for
the checkpoint's arch, so the run must agree with pdm_model.json field by field), with
`checkpoint.load_dir` pointing at the conversion. Every RL step has a finite loss and gradient
norm (a random model mostly earns reward 0, whose zero advantages give zero gradients: the norm
is not asked to be positive).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.support._dist import run_tool
from tests.support._launch import launch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.mark.gloo
def test_dense_tied_llama_trains_from_a_converted_checkpoint(tmp_path):
    from megatron_pdm.arch import ModelArch, format_arch
    from megatron_pdm.convert.hf_io import read_hf_config
    from megatron_pdm.convert.tiny import make_tiny_dense_hf
    from megatron_pdm.tools.convert_hf_to_megatron import convert_hf_to_megatron

    make_tiny_dense_hf(tmp_path / "hf", "llama")
    run_tool(convert_hf_to_megatron, 2, str(tmp_path / "hf"), str(tmp_path / "mcore"), tp=2)
    arch = ModelArch.from_hf_config(read_hf_config(tmp_path / "hf"))
    tokens = format_arch(arch, "sets").split("\n")
    model_sets = [tok for tok in tokens if tok != "--set"]
    out = str(tmp_path / "run")
    launch(out, model_sets + [f"checkpoint.load_dir={tmp_path / 'mcore'}", "warmup.steps=2",
                              "train.iterations=2", "checkpoint.save_interval=0"], timeout=600)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rl = [r for r in rows if "loss/pg" in r]
    assert len(rl) == 4, rows[-3:]  # 2 iterations x 2 minibatches
    for r in rl:
        assert math.isfinite(r["loss/pg"]) and math.isfinite(r["grad_norm"]), r
