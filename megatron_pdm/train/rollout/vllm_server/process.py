"""The vLLM server process: one OpenAI-compatible server in its own process group.

`VLLMServer` runs vLLM's OpenAI-compatible server from the vLLM venv (venv.py), after checking
that environment's vLLM release against the supported range, with the flags the bridge needs
(listed in the package docstring, vllm_server/__init__.py). `check_bind_host` keeps the bind
address on loopback or a private interface.

Process hygiene: the server runs in its own session (process group); `stop()` sends SIGTERM to
that group, waits, then SIGKILLs the group: killing only the API server would orphan vLLM's
engine-core and worker processes (docs/engines.md, vLLM). Never kill by name.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_pdm.netutil import free_port
from megatron_pdm.train.rollout.vllm_server.venv import (
    ROOT,
    installed_vllm_version,
    vllm_python,
)

EXT_MODULE = "pdm_vllm_ext"    # rollout_bridge/vllm/worker_ext.py (the worker extension)
AUTH_MODULE = "pdm_vllm_auth"  # rollout_bridge/vllm/server_auth.py (the API-key middleware)


def check_bind_host(host: str) -> None:
    """Loopback or a private address only (dev-mode routes run worker code)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host {host!r}: give an IP address (127.0.0.1 or a private "
                         "interface), not a name") from None
    if not (ip.is_loopback or ip.is_private) or ip.is_unspecified:
        raise ValueError(f"host {host}: the vLLM server runs in dev mode (worker methods over "
                         "HTTP); bind 127.0.0.1 or a private interface, never a public or "
                         "wildcard address")


class VLLMServer:
    """One vLLM OpenAI server process group (see module docstring).

    Args:
        model_dir: HF directory to serve.
        workdir: Log file and the copy of the worker extension go here.
        host, port: Bind address (port None: a free one).
        api_key: The key, an `ApiKey` or a string (None: a random one). Passed as `VLLM_API_KEY`
            in the server's environment; held as an `ApiKey`, so it never prints.
        dtype: vLLM `--dtype` ("float32" on CPU for exactness).
        max_model_len: Context length (default: the config's max_position_embeddings).
        served_model_name: The OpenAI model name.
        extra_args: More server flags.
        venv: The vLLM venv (default $VLLM_VENV, else `default_venv()`).
        kv_cache_bytes: vLLM `--kv-cache-memory-bytes` (64 MiB: the tiny model; a real model
            needs more, e.g. SmolLM2-135M holds ~46 KB of fp32 KV per token).
        omp_threads: OMP threads of the CPU worker (`VLLM_CPU_OMP_THREADS_BIND` stays default).
    """

    def __init__(self, model_dir: str | os.PathLike, workdir: str | os.PathLike, *,
                 host: str = "127.0.0.1", port: int | None = None, api_key=None,
                 dtype: str = "float32", max_model_len: int | None = None,
                 served_model_name: str = "pdm-policy", extra_args: list[str] | None = None,
                 venv: str | os.PathLike | None = None, seed: int = 0,
                 kv_cache_bytes: int = 64 << 20):
        check_bind_host(host)
        # absolute: the server runs in `workdir`, where a relative path means nothing
        self.model_dir = Path(model_dir).resolve()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port(host)
        from rollout_bridge.core.apikey import ApiKey

        self.api_key = ApiKey.of(api_key) or ApiKey(secrets.token_hex(16))
        self.dtype = dtype
        if max_model_len is None:
            cfg = json.loads((self.model_dir / "config.json").read_text())
            max_model_len = int(cfg.get("max_position_embeddings", 2048))
        self.max_model_len = int(max_model_len)
        self.served_model_name = served_model_name
        self.extra_args = list(extra_args or [])
        self.python = vllm_python(venv)
        self.seed = int(seed)
        self.kv_cache_bytes = int(kv_cache_bytes)
        self.log_path = self.workdir / "vllm_server.log"
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []
        """Seconds from launch to a healthy server, one entry per start."""
        self.vllm_version: str | None = None
        """The environment's vLLM release, read (and checked against the supported range,
        rollout_bridge/vllm/versions.py) by the first `start`."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
            "--logprobs-mode", "processed_logprobs", "--skip-tokenizer-init",
            "--no-enable-chunked-prefill", "--enforce-eager", "--generation-config", "vllm",
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--middleware", f"{AUTH_MODULE}.BearerAuthEverywhereMiddleware",
            "--worker-extension-cls", f"{EXT_MODULE}.VLLMWeightSyncExtension",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        ext_dir = self.workdir / "ext"
        ext_dir.mkdir(exist_ok=True)
        # Copies as top-level modules: putting rollout_bridge/ on the path would shadow the
        # standard library's `types` (rollout_bridge/vllm/worker_ext.py docstring).
        for source, module in (("worker_ext.py", EXT_MODULE), ("server_auth.py", AUTH_MODULE)):
            shutil.copy(ROOT / "rollout_bridge" / "vllm" / source, ext_dir / f"{module}.py")
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VLLM_API_KEY", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                            "MASTER_ADDR", "MASTER_PORT")}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_API_KEY=self.api_key.reveal(),
                   PYTHONPATH=str(ext_dir),
                   VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
                   PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   HF_HUB_OFFLINE="1")
        return env

    def start(self) -> VLLMServer:
        """Launches the server (own session / process group); returns at once."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"server already running (pid {self.proc.pid})")
        if not self.python.exists():
            raise FileNotFoundError(f"{self.python} not found: create the vLLM venv with "
                                    "scripts/setup_vllm_cpu.sh")
        if self.vllm_version is None:  # once per server object (restarts reuse it)
            self.vllm_version = installed_vllm_version(self.python)
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {time.strftime('%H:%M:%S')} port {self.port}\n".encode())
        log.flush()
        self._t_start = time.time()
        self.proc = subprocess.Popen(self.command(), cwd=str(self.workdir),
                                     env=self.environment(), stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        return self

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Polls /health until 200; returns the start-up time. Raises with the log tail."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} during "
                                   f"start-up:\n{self.log_tail()}")
            if self.healthy():
                took = time.time() - self._t_start
                self.starts.append(took)
                return took
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILLs the whole process group at once (a crash, for fault tests)."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the process group, then SIGKILL after `grace_s`; waits for the exit."""
        if self.proc is None:
            return
        pid = self.proc.pid
        if self.proc.poll() is None:
            _signal_group(pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (engine core, worker): always sweep it.
        _signal_group(pid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.time() + 10
        while _group_alive(pid) and time.time() < deadline:
            time.sleep(0.2)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
