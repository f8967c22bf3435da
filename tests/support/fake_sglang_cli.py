"""The fake SGLang server (tests/support/fake_sglang.py) as its own process, for the driver tests.

`python tests/support/fake_sglang_cli.py --hf-dir DIR --port-file F [--log-file L]
[--api-key-env VAR] [--receiver auto|mirror|sglang]`. The log gets each call (but /generate) as
one JSON line before the call is answered; the /generate count goes to L.generate every 0.2 s
and when the server stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(__file__))

from fake_models import HFModelEngine  # noqa: E402
from fake_sglang import FakeSGLangServer  # noqa: E402

from rollout_bridge import LocalEngine  # noqa: E402


def main(argv=None) -> None:
    """Serve until SIGTERM/SIGINT; one JSON line per control call in --log-file."""

    parser = argparse.ArgumentParser(description="fake SGLang server (HF model dir or TinyLM)")
    parser.add_argument("--hf-dir", default=None)
    parser.add_argument("--tiny-lm", action="store_true",
                        help="serve tests/support/tiny_lm.py TinyLM")
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-file", default=None, help="append one JSON line per control call")
    parser.add_argument("--api-key-env", default=None, help="env var holding --api-key")
    parser.add_argument("--receiver", default="auto", choices=("auto", "mirror", "sglang"))
    parser.add_argument("--discard-weights", action="store_true", help="receive, don't load")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.tiny_lm:
        from tiny_lm import VOCAB, TinyLM

        engine = LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=5, seed=args.seed,
                             eos_token_id=3)
        model_path = "tiny-lm"
    else:
        engine = HFModelEngine(args.hf_dir, seed=args.seed)
        model_path = args.hf_dir
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    server = FakeSGLangServer(engine, model_path=model_path, api_key=key, receiver=args.receiver)
    server.deterministic_seeds = True
    server.discard_weights = args.discard_weights
    if args.receiver == "sglang":  # import sglang's WeightUpdater before serving (slow import)
        from sglang_receiver import make_receiver

        server.receiver = make_receiver("sglang")
    if args.log_file:  # before the server answers anything
        server.call_log_fd = os.open(args.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    server.start()
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.port))
    os.replace(tmp, args.port_file)
    print(f"fake SGLang server on {server.url}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())

    def flush():
        if args.log_file:  # /generate requests are counted, not logged (they are many)
            with open(args.log_file + ".generate.tmp", "w") as f:
                f.write(str(server.num_generate))
            os.replace(args.log_file + ".generate.tmp", args.log_file + ".generate")

    try:
        while not stop.wait(0.2):
            flush()
    except KeyboardInterrupt:
        pass
    flush()
    server.stop()
    os._exit(0)


if __name__ == "__main__":
    main()
