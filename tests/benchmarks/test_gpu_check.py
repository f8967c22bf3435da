"""benchmarks/gpu_check.py at its real sizes on one GPU (skipped without CUDA; the CPU smoke
mode of the same script runs in tests/benchmarks/test_gpu_check_parts.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_runs_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(report["parts"], indent=1)
    parts = report["parts"]
    assert parts["correctness"]["result"]["fp32"]["worst"] < 1e-3
    assert parts["no_host_sync"]["status"] == "ok"
    assert len(parts["op_vs_ce"]["result"]["rows"]) == 8
    assert len(parts["op_matrix"]["result"]["rows"]) == 6  # N 2048, 8192 x TP 2, 4, 8
    assert parts["optimizer_step"]["result"]["grad_norm_finite"]
