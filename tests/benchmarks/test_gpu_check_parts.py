"""benchmarks/gpu_check.py in its CPU smoke mode: every part runs isolated, the JSON has each
part's shape, and one failing part neither stops the others nor loses the JSON already written.

The real check (CUDA sizes) runs in tests/benchmarks/test_gpu_check.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *args, env_extra=None):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text())


def test_smoke_mode_runs_every_part_and_writes_each_parts_shape(tmp_path):
    proc, report = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["mode"] == "smoke" and report["environment"]["torch"]
    parts = report["parts"]
    assert list(parts) == ["correctness", "no_host_sync", "op_vs_ce", "op_matrix",
                           "optimizer_step"]
    for entry in parts.values():
        assert entry["status"] in ("ok", "skipped") and entry["seconds"] <= entry["budget_s"]
    corr = parts["correctness"]["result"]
    for dtype in ("fp32", "bf16"):
        assert corr[dtype]["worst"] < 1e-4, corr[dtype]
        assert "logprob_vs_log_softmax" in corr[dtype]["max_abs_diff"]
    assert corr["fp64_logprob_vs_log_softmax"] < 1e-10
    # no CUDA here: the sync check says why it did not run
    if not torch.cuda.is_available():
        assert parts["no_host_sync"] == {**parts["no_host_sync"], "status": "skipped"}
        assert "CUDA" in parts["no_host_sync"]["reason"]
    rows = parts["op_vs_ce"]["result"]["rows"]
    assert {(r["vocab"], r["dtype"]) for r in rows} == {(1000, "bf16"), (1000, "fp32"),
                                                       (250, "bf16"), (250, "fp32")}
    assert all(r["ratio_time"] == r["pdm_ms"] / r["ce_ms"] for r in rows)
    for r in rows:  # bf16 logits: also the op on their fp32 copy (the logits-dtype decision)
        assert ("ratio_time_cast_vs_bf16" in r) is (r["dtype"] == "bf16"), r
        if r["dtype"] == "bf16":
            assert r["ratio_time_cast_vs_bf16"] == r["pdm_fp32_cast_ms"] / r["pdm_ms"]
    assert parts["op_vs_ce"]["result"]["validate"] is False
    matrix = parts["op_matrix"]["result"]["rows"]  # the bf16 Qwen3 shards of the CPU matrix
    assert [(r["tp"], r["vocab_local"]) for r in matrix] == [(2, 76032), (4, 38016), (8, 19072)]
    for r in matrix:
        assert r["dtype"] == "bf16" and r["tokens"] == 16 and r["rounds"] == 1
        assert abs(r["vs_ce_paired"] - r["op_ms"] / r["ce_ms"]) < 1e-9  # one round
        assert r["memory_vs_ce"] is None or not torch.cuda.is_available()
    step = parts["optimizer_step"]["result"]
    assert step["layers"] == 2 and step["grad_norm_finite"]
    assert step["params_changed"] == step["params_total"] > 0


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path):
    """A part that crashes (here: megatron's import poisoned for the child processes) reports
    failed/skipped with its reason; the parts without megatron still pass."""
    stub = tmp_path / "stub"
    (stub / "megatron").mkdir(parents=True)
    (stub / "megatron" / "__init__.py").write_text("raise ImportError('no megatron here')\n")
    proc, report = _run(tmp_path, "--parts", "correctness,op_vs_ce,op_matrix,optimizer_step",
                        env_extra={"PYTHONPATH": f"{stub}{os.pathsep}{ROOT}"})
    parts = report["parts"]
    assert parts["correctness"]["status"] == "ok"
    for name in ("op_vs_ce", "op_matrix", "optimizer_step"):
        assert parts[name]["status"] == "skipped", parts[name]
        assert "no megatron here" in parts[name]["reason"]


def test_a_part_over_its_budget_fails_without_losing_the_json(tmp_path, monkeypatch):
    gc = _load()
    monkeypatch.setitem(gc.BUDGET_S, "correctness", (1, 0.01))
    out = tmp_path / "check.json"
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    rc = gc.main(["--smoke", "--out", str(out), "--parts", "correctness,no_host_sync"])
    report = json.loads(out.read_text())
    assert rc == 1 and report["parts"]["correctness"]["status"] == "failed"
    assert "budget" in report["parts"]["correctness"]["reason"]
    assert report["parts"]["no_host_sync"]["status"] in ("ok", "skipped")


def test_synthetic_rollout_is_a_valid_support():
    gc = _load()
    logits = torch.randn(16, 1024)
    batch = gc.synthetic_rollout(logits, top_k=4, vocab_size=1000)
    assert (batch["support_ids"] < 1000).all()
    assert torch.equal(batch["support_ids"][:, 0], batch["sampled_ids"])
    dup = batch["support_ids"][:, 1:] == batch["sampled_ids"][:, None]
    assert torch.equal(batch["support_valid"][:, 1:], ~dup)
