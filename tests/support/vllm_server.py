"""Real-vLLM tests: one vLLM OpenAI server process (the `.venv-vllm` made by
scripts/setup_vllm_cpu.sh) shared by the session, serving the tiny CPU model.

A plugin of tests/conftest.py: the marker `vllm_server` and the session fixture of that name
serve a test in any folder (a test asking for the fixture gets the marker).

The server is launched as soon as collection finds `vllm_server`-marked tests, so its start-up (a
minute or more on 2 cores: three processes importing vLLM) overlaps the rest of the suite; the
`vllm_server` fixture waits for it. It binds 127.0.0.1 on a free port, runs in its own process
group with a random API key in its environment, and is stopped (group SIGTERM, then SIGKILL; by
PID, never by name) when the session ends.

Skips: only when the vLLM venv is missing or unstamped (scripts/setup_vllm_cpu.sh failed or was
not run; `make test` runs it first). PDM_REQUIRE_VLLM=1 turns that skip into a failure.
"""

from __future__ import annotations

import atexit
import os
import secrets
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
CONFIG = ROOT / "examples" / "tiny_cpu" / "config.yaml"
# The served architecture: the tiny demo model (head_dim 32 is what vLLM's CPU attention needs;
# pinned here so the tests do not depend on the example's other settings).
MODEL_OVERRIDES = ["model.head_dim=32"]
KEY_ENV = "PDM_VLLM_API_KEY"
START_TIMEOUT_S = float(os.environ.get("PDM_VLLM_START_TIMEOUT", "900"))

_STATE: dict = {}


def venv_problem() -> str | None:
    """Why the vLLM venv is not usable, or None."""
    if not (VENV / "bin" / "python").exists():
        return f"no vLLM venv at {VENV} (create it with scripts/setup_vllm_cpu.sh)"
    if not (VENV / ".pdm-vllm-setup-stamp").exists():
        return (f"{VENV} is not stamped: scripts/setup_vllm_cpu.sh did not finish (run it to "
                "see why)")
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm_server: needs the real vLLM CPU server (.venv-vllm, "
                                       "fixture vllm_server)")
    config.addinivalue_line("markers", "kills_vllm_server: kills the session's vLLM server; "
                                       "ordered after every other test")


def _start_server():
    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.rollout.vllm_server.model_dir import prepare_model_dir, run_arch
    from megatron_pdm.train.rollout.vllm_server.process import VLLMServer

    work = Path(tempfile.mkdtemp(prefix="pdm_vllm_tests_"))
    cfg = RunConfig.load(str(CONFIG), MODEL_OVERRIDES)
    arch = run_arch(cfg)
    model_dir = prepare_model_dir(arch, work / "model", seed=0)
    key = secrets.token_hex(16)
    server = VLLMServer(model_dir, work, api_key=key, dtype="float32",
                        max_model_len=arch.max_position_embeddings, seed=0)
    server.start()
    atexit.register(server.stop)
    _STATE.update(server=server, arch=arch, key=key, work=work)


def pytest_collection_modifyitems(config, items):
    # A test that kills the session's server (marker kills_vllm_server) runs after every other
    # test: the session fixture does not restart the server for later users.
    last = {id(i) for i in items if i.get_closest_marker("kills_vllm_server") is not None}
    if last:
        items[:] = [i for i in items if id(i) not in last] + [i for i in items if id(i) in last]
    wanted = [i for i in items if i.get_closest_marker("vllm_server") is not None]
    if not wanted:
        return
    problem = venv_problem()
    if problem is not None:
        if os.environ.get("PDM_REQUIRE_VLLM") == "1":
            raise pytest.UsageError(f"PDM_REQUIRE_VLLM=1 but {problem}")
        skip = pytest.mark.skip(reason=f"vLLM venv unavailable: {problem}")
        for item in wanted:
            item.add_marker(skip)
        return
    _start_server()


def pytest_sessionfinish(session, exitstatus):
    server = _STATE.get("server")
    if server is not None:
        server.stop()


class Served:
    """The running server plus what a test needs to use it."""

    def __init__(self, state: dict):
        self.server = state["server"]
        self.arch = state["arch"]
        self.key = state["key"]
        self.work = state["work"]

    @property
    def url(self) -> str:
        return self.server.url

    def env(self) -> dict[str, str]:
        return {KEY_ENV: self.key}

    def ensure_up(self) -> None:
        """Restarts the server if a test left it dead."""
        if self.server.proc.poll() is not None or not self.server.healthy():
            self.server.stop()
            self.server.start()
            self.server.wait_ready(START_TIMEOUT_S)

    def engine(self, **kw):
        from rollout_bridge.vllm.client import VLLMEngine

        args = dict(top_logprobs=8, api_key=self.key, vocab_size=self.arch.vocab_size,
                    timeout_s=300, seed=0)
        args.update(kw)
        return VLLMEngine(self.url, **args)


@pytest.fixture(scope="session")
def vllm_server():
    if "server" not in _STATE:
        pytest.skip("vLLM server not started (venv unavailable)")
    server = _STATE["server"]
    if not server.starts:
        server.wait_ready(START_TIMEOUT_S)
        print(f"\nvLLM server ready after {server.starts[-1]:.0f} s", flush=True)
    served = Served(_STATE)
    served.ensure_up()
    return served
