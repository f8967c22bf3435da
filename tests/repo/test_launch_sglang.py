"""examples/qwen3_30b_a3b/launch_sglang.sh: servers need the API key and never bind publicly."""

from __future__ import annotations

import os
import subprocess
import sys
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
    assert '--config "${KEY_FILE}"' in launch and "--api-key" not in launch
    assert '--host "${HOST}"' in launch and "0.0.0.0" not in text
    assert 'HOST="${HOST:-127.0.0.1}"' in text
    # FP8: quantised on load per tensor, the trainer's default simulation (rollout.local.fp8_scales)
    assert "--quantization fp8" in text and "fp8_scales=tensor" in text


_FAKE_SGLANG = """#!/usr/bin/env bash
# stands in for `python -m sglang.launch_server`: records its argv and the --config file, then logs
# server_args the way sglang 0.5.23 does (api_key included, at INFO)
if [[ "$1" == "-m" && "$2" == "sglang.launch_server" ]]; then
    printf '%s\\n' "$@" > "$RECORD/argv"
    while [[ $# -gt 0 ]]; do
        if [[ "$1" == "--config" ]]; then cp "$2" "$RECORD/config"; stat -c %a "$2" > "$RECORD/mode"; fi
        shift
    done
    key=$(REAL_PY_KEY=1 "$REAL_PYTHON" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["api-key"])' "$RECORD/config")
    echo "[info] server_args={'api_key': '$key', 'port': 30000}"
    exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def test_the_key_is_in_neither_argv_nor_the_server_log(tmp_path):
    """The key reaches sglang through a private --config file; the logged server_args are
    filtered (sglang logs api_key at INFO). Failed before: the key was an --api-key argument and
    went verbatim into server_<port>.log."""
    key = "s3cret-key-/+=\"quote'"
    bin_dir, record, logs = tmp_path / "bin", tmp_path / "record", tmp_path / "logs"
    bin_dir.mkdir()
    record.mkdir()
    fake = bin_dir / "python"
    fake.write_text(_FAKE_SGLANG)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               REAL_PYTHON=sys.executable, RECORD=str(record), LOG_DIR=str(logs),
               PDM_SGLANG_API_KEY=key)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = (record / "argv").read_text()
    assert key not in argv and "--api-key" not in argv and "--config" in argv
    import yaml

    assert yaml.safe_load((record / "config").read_text()) == {"api-key": key}
    assert (record / "mode").read_text().strip() == "600"
    log = (logs / "server_30000.log").read_text()
    assert "server_args=" in log and "<redacted>" in log, log
    assert key not in log and key not in proc.stdout + proc.stderr
