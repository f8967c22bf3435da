"""CLI (`python -m megatron_pdm.train.rollout.vllm_server`, `megatron-pdm-vllm-server`).

  --config CFG [--set k=v ...] [--port P] [--host H] [--workdir D] [--model-dir HF]
  [--max-model-len N] [--kv-cache-mb M] [-- CMD ...]

`--model-dir` serves an existing HF directory (the real model, docs/real-model.md) instead of
`prepare_model_dir`'s random one. Starts the server, prints its URL, and either waits (Ctrl-C
stops it) or runs CMD (every `{vllm_url}` in it replaced by the URL; `PDM_VLLM_URL` and the API
key variable exported), then stops the server and exits with CMD's status.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_pdm.train.rollout.vllm_server.model_dir import prepare_model_dir, run_arch
from megatron_pdm.train.rollout.vllm_server.process import VLLMServer

DEFAULT_KEY_ENV = "PDM_VLLM_API_KEY"
_DESCRIPTION = ("Start and stop a CPU vLLM server for a run config (tests, `make demo-vllm`, "
                "benchmarks).")


def main(argv: list[str] | None = None) -> int:
    from megatron_pdm.configtree import ConfigError
    from megatron_pdm.train.config import RunConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="python -m megatron_pdm.train.rollout.vllm_server",
                                     description=_DESCRIPTION)
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
