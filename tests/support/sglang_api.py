"""Checks against the installed sglang packages (both supported versions), marker `sglang_api`.

A plugin of tests/conftest.py: the marker and the session fixtures `version` (both versions),
`box` (the running box) and `report` (its facts) serve a test in any folder.

`make test` creates the API envs first (scripts/sglang_api_env.sh: sglang 0.5.22 and 0.5.23
installed --no-deps on CPU, import stubs for triton/torchvision). For every version one
`sglang_box.py` process is started as soon as collection finds these tests, so its start-up (the
sglang import and a real TokenizerManager: about a minute of CPU on 2 cores) overlaps the rest of
the suite. It writes a facts report (routes, request validation, response formatting, auth) and
then keeps serving sglang's real HTTP app on 127.0.0.1 for the client tests.

Skips: only when an env is missing (the script failed or was not run); PDM_REQUIRE_SGLANG_API=1
turns that skip into a failure (`make test` sets it on machines where the script succeeded).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE)]

from fake_proc import sglang_pythonpath

VERSIONS = ("0.5.22", "0.5.23")
KEY_ENV = "PDM_SGLANG_BOX_KEY"
START_TIMEOUT_S = float(os.environ.get("PDM_SGLANG_BOX_TIMEOUT", "1200"))
_BOXES: dict[str, dict] = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "sglang_api: checks against the installed sglang API "
                                       "envs (scripts/sglang_api_env.sh)")


def env_problem(version: str) -> str | None:
    if sglang_pythonpath(version) is None:
        return (f"sglang {version} API env missing under .cache/sglang-api (create it with "
                "scripts/sglang_api_env.sh; `make test` does)")
    return None


def _start_box(version: str) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"sglang_box_{version}_"))
    key = secrets.token_hex(16)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), sglang_pythonpath(version)]),
               **{KEY_ENV: key})
    stderr = open(work / "stderr", "w")
    proc = subprocess.Popen(
        [sys.executable, "-W", "ignore", str(HERE / "sglang_box.py"), "--port-file",
         str(work / "port"), "--log-file", str(work / "log.jsonl"), "--api-key-env", KEY_ENV,
         "--workdir", str(work), "--report", str(work / "report.json")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    box = {"proc": proc, "work": work, "key": key, "started": time.time(), "stderr": stderr}
    _BOXES[version] = box

    def stop():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        stderr.close()

    atexit.register(stop)
    box["stop"] = stop


def pytest_collection_modifyitems(config, items):
    wanted = [i for i in items if i.get_closest_marker("sglang_api") is not None]
    if not wanted:
        return
    for version in VERSIONS:
        problem = env_problem(version)
        if problem is None:
            if version not in _BOXES:
                _start_box(version)
            continue
        if os.environ.get("PDM_REQUIRE_SGLANG_API") == "1":
            raise pytest.UsageError(f"PDM_REQUIRE_SGLANG_API=1 but {problem}")
        skip = pytest.mark.skip(reason=problem)
        for item in wanted:
            if item.callspec.params.get("version") == version if hasattr(item, "callspec") \
                    else False:
                item.add_marker(skip)


class Box:
    """A running sglang_box: its URL, API key, report and call log."""

    def __init__(self, version: str, info: dict):
        self.version, self.work, self.key = version, info["work"], info["key"]
        self.url = f"http://127.0.0.1:{int((self.work / 'port').read_text())}"
        self.report = json.loads((self.work / "report.json").read_text())

    def log(self) -> list[dict]:
        time.sleep(0.3)
        path = self.work / "log.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]


def wait_box(version: str) -> Box:
    problem = env_problem(version)
    if problem is not None:
        pytest.skip(problem)
    if version not in _BOXES:
        _start_box(version)
    info = _BOXES[version]
    while not ((info["work"] / "port").exists() and (info["work"] / "report.json").exists()):
        if info["proc"].poll() is not None or time.time() - info["started"] > START_TIMEOUT_S:
            info["stderr"].flush()
            tail = (info["work"] / "stderr").read_text()[-4000:]
            raise RuntimeError(f"sglang {version} box did not start:\n{tail}")
        time.sleep(0.5)
    info.setdefault("ready_s", time.time() - info["started"])
    return Box(version, info)


@pytest.fixture(scope="session", params=VERSIONS)
def version(request):
    return request.param


@pytest.fixture(scope="session")
def box(version) -> Box:
    b = wait_box(version)
    if "error" in b.report:
        raise AssertionError(f"sglang {version} report failed:\n{b.report['error']}")
    return b


@pytest.fixture(scope="session")
def report(box) -> dict:
    return box.report
