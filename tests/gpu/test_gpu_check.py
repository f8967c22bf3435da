"""benchmarks/gpu_check.py end to end on one GPU (skipped without CUDA; CPU parts in tests/unit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.mark.gpu
def test_gpu_check_script_runs(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out",
            str(out),
            "--layers",
            "1",
            "--seq-len",
            "512",
            "--tokens",
            "1024",
            "--iters",
            "3",
        ],
        check=True,
        env=env,
        timeout=900,
    )
    result = json.loads(out.read_text())
    assert result["fp8_slice"]["loss_finite"] and result["fp8_slice"]["grads_finite"]
    assert result["op_bench"]["pdm_fwd_bwd_ms"] > 0
