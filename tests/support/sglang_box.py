"""SGLang's own HTTP server code on a CPU: the real FastAPI app, the real TokenizerManager, the
real scheduler-side weight-update manager and the real model-runner WeightUpdater, with only the
GPU parts replaced. Run under an installed sglang API env (scripts/sglang_api_env.sh):

    PYTHONPATH=<repo>:$(cat .cache/sglang-api/0.5.23/pythonpath) .venv/bin/python \
        tests/support/sglang_box.py --port-file F [--log-file L] [--api-key-env V]

What is sglang's code (imported from the installed package, both supported versions):
  * `sglang.srt.entrypoints.http_server.app` (routes, request parsing into the io_struct
    classes, the /generate contract gate, error shapes), served by uvicorn on 127.0.0.1, with
    `add_api_key_middleware` when an API key is given;
  * `TokenizerManager` (--skip-tokenizer-init): request normalisation and validation, pause /
    continue, the control-plane communicators, weight_version bookkeeping, /model_info, and the
    response formatting (`_handle_batch_output`, flat/base64 top-K);
  * the zmq wire encoding (`io_struct.msgpack_encode/decode`) of every message both ways;
  * `SchedulerWeightUpdaterManager` (the weight-update session, update_weights_from_distributed
    receive -> load -> version -> cache flush) and `TpModelWorker`'s delegation methods, called
    with the request types the real scheduler dispatches to them (scheduler.py:1827-1925);
  * the model-runner `WeightUpdater`: group init (`init_custom_process_group`) and the receive
    of both load formats, over gloo.

What is replaced (no CUDA): the scheduler's batching and the model. `CpuScheduler`
(sglang_box_scheduler.py) answers each
tokenized generate request with tokens and log-probs from `LocalEngine` over tests/support's
TinyLM (output logprobs tempered, prompt rows untempered with a null row at logprob_start_len, as
logprob_result_processor.py / logprob_processor.py do), and the "model" is TinyLM behind a
`load_weights(named_tensors)` method. Each received-and-loaded state is logged with its digest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(__file__)]

import torch

from megatron_pdm.netutil import free_port
from sglang_box_report import make_report  # noqa: E402
from sglang_box_scheduler import CpuScheduler, _SchedulerSocket  # noqa: E402

VOCAB = 50


def write_model_dir(path: str) -> str:
    """An HF config the TokenizerManager can read (vocab = TinyLM's real vocabulary)."""
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "torch_dtype": "float32", "tie_word_embeddings": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path




def build(model_dir: str, api_key: str | None, log, seed: int = 1):
    """(http_server module, app, startup coroutine factory). Imports sglang."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    sa = ServerArgs(model_path=model_dir, skip_tokenizer_init=True, device="cpu",
                    weight_version="0", api_key=api_key)
    publish(sa, role="tokenizer")
    from tiny_lm import TinyLM
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager

    from rollout_bridge import LocalEngine

    tm = TokenizerManager(sa, PortArgs.init_new(sa))
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None,
                                        scheduler_info={}))
    if api_key:
        from sglang.srt.utils.auth import add_api_key_middleware

        add_api_key_middleware(hs.app, api_key=api_key, admin_api_key=None)
    engine = LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=5, seed=seed, eos_token_id=3)
    state = {}

    async def startup():
        loop = asyncio.get_running_loop()
        tm.event_loop = loop  # no zmq handle_loop: the CPU scheduler answers
        tm.server_status = ServerStatus.Up
        sched = CpuScheduler(tm, loop, engine, log)
        tm.send_to_scheduler = _SchedulerSocket(sched.inbox)
        state["scheduler"] = sched

    return hs, tm, engine, startup, state


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--log-file", default=None)
    ap.add_argument("--api-key-env", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--report", default=None, help="write the facts report (JSON) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="sglang_box_")
    lock = threading.Lock()

    def log(entry):
        if args.log_file:
            with lock, open(args.log_file, "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")

    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    hs, tm, _engine, startup, state = build(write_model_dir(os.path.join(workdir, "model")), key,
                                        log, seed=args.seed)
    import uvicorn

    port = free_port()
    config = uvicorn.Config(hs.app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off")
    server = uvicorn.Server(config)

    async def serve():
        await startup()
        if args.report:
            try:
                rep = await make_report(hs, tm, state["scheduler"], key, vocab_size=VOCAB)
            except Exception:  # noqa: BLE001 - the tests report it
                rep = {"error": traceback.format_exc()}
            with open(args.report + ".tmp", "w") as f:
                json.dump(rep, f, default=str)
            os.replace(args.report + ".tmp", args.report)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
        await task

    import signal

    signal.signal(signal.SIGTERM, lambda *a: setattr(server, "should_exit", True))
    asyncio.run(serve())
    os._exit(0)


if __name__ == "__main__":
    main()
