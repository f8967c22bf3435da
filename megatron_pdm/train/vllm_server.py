"""Start and stop a CPU vLLM server for a run config (tests, `make demo-vllm`, benchmarks).

What: `prepare_model_dir` writes an HF Qwen3-MoE directory (config.json + random safetensors) of
the run's architecture (`model` section, vocabulary from the task), so vLLM serves exactly the
network the trainer trains; the trainer then pushes its own weights before the first rollout
(`rollout.sync_at_start`), so the random start weights never produce a rollout. `VLLMServer`
runs vLLM's OpenAI-compatible server (`.venv-vllm`, scripts/setup_vllm_cpu.sh), after checking
that environment's vLLM release against the supported range (`installed_vllm_version`,
rollout_bridge/vllm/versions.py), with the flags the bridge needs (docs/engines.md, vLLM):

  --logprobs-mode processed_logprobs   returned log-probs are log_softmax(logits / T)
  --skip-tokenizer-init                token ids in and out, no tokenizer needed
  --no-enable-chunked-prefill          per-request seeds (vLLM refuses seeds with it on CPU)
  --enforce-eager                      no torch.compile: 11-27 s less start-up, not slower here
  --generation-config vllm             ignore a model's generation_config.json sampling defaults
  --worker-extension-cls / --middleware   weight sync over /collective_rpc, and the API key
                                       required on every route (vLLM's --api-key guards /v1 only)

Security: the server binds 127.0.0.1 unless `host` names a private (RFC 1918 / ULA) address;
dev mode (`VLLM_SERVER_DEV_MODE=1`, needed for /collective_rpc, /pause, /update_weight_version)
lets whoever reaches the port run worker methods, so the key is required everywhere by
`BearerAuthEverywhereMiddleware` and comes from the environment (`VLLM_API_KEY`, never the
command line, which `ps` shows).

Process hygiene: the server runs in its own session (process group); `stop()` sends SIGTERM to
that group, waits, then SIGKILLs the group: killing only the API server would orphan vLLM's
engine-core and worker processes (docs/engines.md, vLLM). Never kill by name.

CLI (`python -m megatron_pdm.train.vllm_server`):
  --config CFG [--set k=v ...] [--port P] [--host H] [--workdir D] [--model-dir HF]
  [--max-model-len N] [--kv-cache-mb M] [-- CMD ...]
`--model-dir` serves an existing HF directory (the real model, docs/real-model.md) instead of
`prepare_model_dir`'s random one. Starts the server, prints its URL, and either waits (Ctrl-C
stops it) or runs CMD (every `{vllm_url}` in it replaced by the URL; `PDM_VLLM_URL` and the API
key variable exported), then stops the server and exits with CMD's status.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_pdm.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV_ENV = "VLLM_VENV"  # the vLLM venv's path, overriding the default below


def default_venv(root: Path = ROOT) -> Path:
    """<repo>/.venv-vllm in a source checkout (where scripts/setup_vllm_cpu.sh puts it);
    ./.venv-vllm of the working directory for an installed wheel (never inside site-packages)."""
    if (root / "setup.py").exists() and (root / "megatron_pdm").is_dir():
        return root / ".venv-vllm"
    return Path.cwd() / ".venv-vllm"

EXT_MODULE = "pdm_vllm_ext"
DEFAULT_KEY_ENV = "PDM_VLLM_API_KEY"


def vllm_python(venv: str | os.PathLike | None = None) -> Path:
    """The vLLM venv's interpreter: `venv`, else $VLLM_VENV, else `default_venv()`."""
    return Path(venv or os.environ.get(VENV_ENV) or default_venv()) / "bin" / "python"


def installed_vllm_version(python: str | os.PathLike) -> str:
    """The vLLM release installed for interpreter `python`, checked against the supported range.

    Asks the interpreter itself (`python -I -c rollout_bridge.vllm.versions.PROBE`: the installed
    distributions' metadata, without importing vLLM), so it is the release the server would run.

    Raises:
        UnsupportedVLLMVersion: no vLLM installed there, or a release outside the range of
            rollout_bridge/vllm/versions.py; the message names the interpreter and the version.
    """
    from rollout_bridge.vllm.versions import (
        PROBE,
        UnsupportedVLLMVersion,
        check_vllm_version,
        supported_text,
    )

    where = f"the vLLM environment {python}"
    try:
        out = subprocess.run([str(python), "-I", "-c", PROBE], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        raise UnsupportedVLLMVersion(f"{where}: its vLLM version cannot be read ({err})") from None
    if found is None:
        raise UnsupportedVLLMVersion(f"{where}: its vLLM version cannot be read (exit "
                                     f"{out.returncode}: {out.stderr.strip()[-300:]})")
    if not isinstance(found, dict) or not found:
        raise UnsupportedVLLMVersion(f"{where}: no vLLM installed (supported: vLLM "
                                     f"{supported_text()}; scripts/setup_vllm_cpu.sh)")
    if len(set(found.values())) > 1:
        raise UnsupportedVLLMVersion(f"{where}: several vLLM distributions installed ({found}); "
                                     "keep one")
    name, version = sorted(found.items())[0]
    check_vllm_version(version, f"{where} ({name})")
    return version


def check_servable(arch) -> None:
    """Refuses architectures vLLM's CPU backend cannot serve or reload in place."""
    from megatron_pdm.configtree import ConfigError

    if arch.head_dim < 32:
        raise ConfigError(f"model.head_dim={arch.head_dim}: vLLM's CPU attention needs "
                          "head_dim >= 32")
    if arch.num_experts and arch.moe_ffn_hidden_size % 32:
        raise ConfigError(f"model.moe_ffn_hidden_size={arch.moe_ffn_hidden_size}: vLLM's CPU MoE "
                          "kernel pads it to a multiple of 32, and a padded layer cannot be "
                          "reloaded in place (weight sync)")


def run_arch(cfg):
    """The run's `ModelArch` with the vocabulary resolved (task tokenizer or checkpoint)."""
    from megatron_pdm.train import model_setup as ms
    from megatron_pdm.train.task import build_task

    task = build_task(cfg)
    meta = ms.read_checkpoint_meta(cfg.checkpoint.load_dir) if cfg.checkpoint.load_dir else None
    return ms.resolve_arch(cfg, task.vocab_size, meta=meta)


def prepare_model_dir(arch, out_dir: str | os.PathLike, *, seed: int = 0,
                      dtype: str = "float32") -> Path:
    """An HF directory of `arch` (its family: Qwen3-MoE, dense Qwen3, Llama) with random weights.

    The weights only have to have the right names and shapes: the trainer pushes its own before
    the first rollout. Norm weights are ones, the rest N(0, 0.02).
    """
    import torch
    from safetensors.torch import save_file

    from megatron_pdm.convert import mapping

    check_servable(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = arch.to_hf_config()
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in mapping.hf_shapes(arch, "per_expert").items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * 0.02
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    return out


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
            "--middleware", f"{EXT_MODULE}.BearerAuthEverywhereMiddleware",
            "--worker-extension-cls", f"{EXT_MODULE}.VLLMWeightSyncExtension",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        ext_dir = self.workdir / "ext"
        ext_dir.mkdir(exist_ok=True)
        # A copy as a top-level module: putting rollout_bridge/ on the path would shadow the
        # standard library's `types` (rollout_bridge/vllm/worker_ext.py docstring).
        shutil.copy(ROOT / "rollout_bridge" / "vllm" / "worker_ext.py",
                    ext_dir / f"{EXT_MODULE}.py")
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


def main(argv: list[str] | None = None) -> int:
    from megatron_pdm.configtree import ConfigError
    from megatron_pdm.train.config import RunConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="python -m megatron_pdm.train.vllm_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--workdir", default=None, help="model dir + log (default: a temp dir)")
    parser.add_argument("--key-env", default=DEFAULT_KEY_ENV,
                        help="environment variable holding the API key (generated if unset)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model-dir", default=None,
                        help="serve this HF directory (e.g. the real model) instead of a random "
                             "one of the config's architecture; the trainer still pushes its "
                             "weights before the first rollout")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="vLLM KV cache size")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    cfg = RunConfig.load(args.config, args.set)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdm_vllm_"))
    if args.model_dir:
        model_dir = Path(args.model_dir)
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"--model-dir {model_dir}: no config.json (an HF model "
                                    "directory is needed; the real model: make real-model)")
        max_model_len = args.max_model_len
    else:
        arch = run_arch(cfg)
        model_dir = prepare_model_dir(arch, workdir / "model", seed=cfg.seed)
        max_model_len = args.max_model_len or arch.max_position_embeddings
    from rollout_bridge.core.apikey import ApiKey, read_api_key

    key = read_api_key(args.key_env) or ApiKey(secrets.token_hex(16))
    server = VLLMServer(model_dir, workdir, host=args.host, port=args.port, api_key=key,
                        dtype=args.dtype, max_model_len=max_model_len, seed=cfg.seed,
                        kv_cache_bytes=args.kv_cache_mb << 20)
    from rollout_bridge.vllm.versions import UnsupportedVLLMVersion

    print(f"vllm_server: starting on {server.url} (log {server.log_path})", flush=True)
    try:
        try:
            server.start()
        except (UnsupportedVLLMVersion, FileNotFoundError) as err:
            raise ConfigError(str(err)) from None  # the environment to fix: one error line
        took = server.wait_ready(args.start_timeout)
        print(f"vllm_server: ready in {took:.0f} s at {server.url}", flush=True)
        if not cmd:
            while server.proc.poll() is None:
                time.sleep(1.0)
            print(f"vllm_server: server exited ({server.proc.returncode})", file=sys.stderr)
            return 1
        env = dict(os.environ, PDM_VLLM_URL=server.url, **{args.key_env: key.reveal()})
        return subprocess.call([c.replace("{vllm_url}", server.url) for c in cmd], env=env)
    except KeyboardInterrupt:
        return 130
    finally:
        server.stop()
        print("vllm_server: stopped", flush=True)



def cli() -> int:
    """Console-script entry point (setup.py `entry_points`): `main` with ConfigError handling."""
    from megatron_pdm.cli import run_cli

    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
