"""examples/qwen3_30b_a3b/launch_sglang.sh: servers need the API key and never bind publicly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "qwen3_30b_a3b" / "launch_sglang.sh"


def test_refuses_to_start_without_the_api_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDM_SGLANG_API_KEY"}
    env["LOG_DIR"] = str(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode != 0
    assert "PDM_SGLANG_API_KEY" in proc.stderr
    assert not list(tmp_path.glob("server_*.log"))  # no server was started


def test_every_server_gets_the_key_and_a_private_bind():
    text = SCRIPT.read_text()
    launch = text[text.index("python -m sglang.launch_server"):]
    launch = launch[:launch.index("&\n")]
    assert '--api-key "${PDM_SGLANG_API_KEY}"' in launch
    assert '--host "${HOST}"' in launch and "0.0.0.0" not in text
    assert 'HOST="${HOST:-127.0.0.1}"' in text
    # FP8: quantised on load per tensor, the trainer's default simulation (rollout.fp8_scales)
    assert "--quantization fp8" in text and "fp8_scales=tensor" in text
