"""Start the fake SGLang server (tests/support/fake_sglang_cli.py) as its own process (127.0.0.1,
free port), stop it by PID.

Used where the server must be another process: a weight-update group needs one process per rank
(torch registers process groups by name per process), and the driver tests run the trainer under
torchrun. `sglang_env` puts the installed sglang API on the server's path, so its receiver is
sglang's own WeightUpdater (scripts/sglang_api_env.sh; None: whatever `--receiver` finds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(ROOT, "tests", "support", "fake_sglang_cli.py")


def sglang_pythonpath(version: str) -> str | None:
    """PYTHONPATH of an installed sglang API env (scripts/sglang_api_env.sh), or None."""
    base = os.environ.get("SGLANG_API_CACHE") or os.path.join(ROOT, ".cache", "sglang-api")
    stamp = os.path.join(base, version, ".stamp")
    path = os.path.join(base, version, "pythonpath")
    if not (os.path.exists(stamp) and os.path.exists(path)):
        return None
    with open(path) as f:
        return f.read().strip()


def read_call_log(path: str) -> list[dict]:
    """The complete lines of a fake server's call log (`--log-file`)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class FakeServerProcess:
    """One fake SGLang server process.

    Args:
        workdir: Where the port file and the call log go.
        args: Extra CLI arguments (e.g. ["--tiny-lm"] or ["--hf-dir", DIR]).
        env: Extra environment (e.g. the API key variable).
        sglang_version: Put that installed sglang API env on the server's PYTHONPATH.
    """

    def __init__(self, workdir: str, args: list[str], env: dict | None = None,
                 sglang_version: str | None = None, start_timeout_s: float = 300.0):
        os.makedirs(workdir, exist_ok=True)
        self.port_file = os.path.join(workdir, "port")
        self.log_file = os.path.join(workdir, "server_calls.jsonl")
        for f in (self.port_file, self.log_file):
            if os.path.exists(f):
                os.remove(f)
        path = [ROOT]
        if sglang_version is not None:
            extra = sglang_pythonpath(sglang_version)
            if extra is None:
                raise RuntimeError(f"sglang {sglang_version} API env not installed")
            path.append(extra)
        full_env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                        PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]))
        full_env.update(env or {})
        self.stderr_path = os.path.join(workdir, "server.stderr")
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, FAKE, "--port-file", self.port_file, "--log-file", self.log_file,
             *args], cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=self._stderr)
        deadline = time.time() + start_timeout_s
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                with open(self.stderr_path) as f:
                    raise RuntimeError(f"fake server failed: {f.read()[-3000:]}")
            time.sleep(0.1)
        with open(self.port_file) as f:
            self.url = f"http://127.0.0.1:{int(f.read())}"

    def calls(self) -> list[dict]:
        """Every call the server has answered (each is logged before it is answered), in order;
        a line still being written by a call in flight is left out."""
        return read_call_log(self.log_file)

    def num_generate(self) -> int:
        """/generate requests the server has answered or is answering (flushed every 0.2 s;
        final once the server has stopped)."""
        path = self.log_file + ".generate"
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            return int(f.read() or 0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._stderr.close()
