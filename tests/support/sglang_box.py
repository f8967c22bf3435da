"""SGLang's own HTTP server code on a CPU: the real FastAPI app, the real TokenizerManager, the
real scheduler-side weight-update manager and the real model-runner WeightUpdater, with only the
GPU parts replaced. Run under an installed sglang API env (scripts/sglang_api_env.sh):

    PYTHONPATH=<repo>:$(cat .cache/sglang-api/0.5.23/pythonpath) .venv/bin/python \
        tests/sglang_api/sglang_box.py --port-file F [--log-file L] [--api-key-env V]

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

What is replaced (no CUDA): the scheduler's batching and the model. `CpuScheduler` answers each
tokenized generate request with tokens and log-probs from `LocalEngine` over tests/bridge's
TinyLM (output logprobs tempered, prompt rows untempered with a null row at logprob_start_len, as
logprob_result_processor.py / logprob_processor.py do), and the "model" is TinyLM behind a
`load_weights(named_tensors)` method. Each received-and-loaded state is logged with its digest.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import queue
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(__file__)]

import torch

from megatron_pdm.netutil import free_port
from sglang_box_report import make_report  # noqa: E402

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


class _Awaitable:
    def __await__(self):
        return iter(())


class _SchedulerSocket:
    """Stands in for the TokenizerManager's zmq socket to the scheduler: the bytes the TM sends
    (msgpack_encode) are decoded with sglang's own msgpack_decode and queued for the scheduler."""

    def __init__(self, inbox: queue.Queue):
        self.inbox = inbox

    def send(self, data, flags=0, **kw):
        from sglang.srt.managers.io_struct import msgpack_decode

        self.inbox.put(msgpack_decode(data))
        return _Awaitable()

    def send_pyobj(self, obj, flags=0, **kw):
        self.inbox.put(obj)
        return _Awaitable()


class TinyModel(torch.nn.Module):
    """TinyLM with SGLang's `load_weights(iterable of (name, tensor))` model API."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.lm = engine.model
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, named):
        named = list(named)
        self.engine._load(dict(named), strict=True)
        for k, v in named:
            self.loaded[k] = v.detach().clone()


class _TpWorker:
    """The attributes `TpModelWorker`'s own methods use (they are called unbound on this)."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self._model_runner = model_runner


class CpuScheduler:
    """Receives what the TokenizerManager dispatches; answers through the TM's own handlers."""

    def __init__(self, tm, loop, engine, log):
        import torch.distributed as dist
        from sglang.srt.managers import tp_worker as tpw
        from sglang.srt.managers.scheduler_components.weight_updater import (
            SchedulerWeightUpdaterManager,
        )
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            WeightUpdater,
        )

        if not dist.is_initialized():  # WeightUpdater asserts a default group; the TP group
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    world_size=1, rank=0)
        self.tm, self.loop, self.engine, self.log = tm, loop, engine, log
        self.model = TinyModel(engine)
        self.weight_updater = WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
            get_model=lambda: self.model, update_model_fields=lambda *a, **k: None,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
        runner = type("ModelRunner", (), {})()
        runner.weight_updater = self.weight_updater
        runner.model = self.model
        worker = _TpWorker(runner)
        worker.init_weights_update_group = lambda req: tpw.TpModelWorker.init_weights_update_group(
            worker, req)
        worker.destroy_weights_update_group = \
            lambda req: tpw.TpModelWorker.destroy_weights_update_group(worker, req)
        worker.weight_update_runners = lambda: tpw.TpModelWorker.weight_update_runners(worker)
        self.versions: list = []
        mgr = object.__new__(SchedulerWeightUpdaterManager)
        for name, value in dict(tp_worker=worker, draft_worker=None, memory_saver_adapter=None,
                                flush_cache=lambda **kw: True, is_fully_idle=lambda **kw: True,
                                scheduler=self, metrics_collector=None, offload_tags=set(),
                                stashed_model_static_state=None, _session=None,
                                tp_cpu_group=dist.group.WORLD).items():
            object.__setattr__(mgr, name, value)
        self.mgr = mgr
        self.inbox: queue.Queue = queue.Queue()
        self.aborted: set = set()
        self.captured: dict[str, dict] = {}
        threading.Thread(target=self._run, daemon=True, name="cpu-scheduler").start()

    # the Scheduler attribute the manager calls
    def record_weight_version_change(self, new_version=None):
        self.versions.append(new_version)

    def _run(self):
        from sglang.srt.managers import io_struct as io

        handlers = {
            io.InitWeightsUpdateGroupReqInput: self.mgr.init_weights_update_group,
            io.DestroyWeightsUpdateGroupReqInput: self.mgr.destroy_weights_update_group,
            io.BeginWeightUpdateReqInput: self.mgr.begin_weight_update,
            io.EndWeightUpdateReqInput: self._end,
            io.UpdateWeightsFromDistributedReqInput: self.mgr.update_weights_from_distributed,
            io.FlushCacheReqInput: lambda req: io.FlushCacheReqOutput(success=True),
            io.GetInternalStateReq: lambda req: io.GetInternalStateReqOutput(
                internal_state={"cpu_scheduler": True}),
        }
        while True:
            obj = self.inbox.get()
            try:
                if isinstance(obj, io.AbortReq):
                    self.aborted.add("*" if obj.abort_all else obj.rid)
                    continue
                if isinstance(obj, (io.ContinueGenerationReqInput, io.PauseGenerationReqInput)):
                    self.aborted.clear()
                    continue
                reqs = getattr(obj, "batch", None)
                if isinstance(obj, (io.TokenizedGenerateReqInput,
                                    io.BatchTokenizedGenerateReqInput)):
                    self._generate(reqs if reqs is not None else [obj])
                    continue
                handler = handlers.get(type(obj))
                if handler is None:
                    self.log({"call": "unhandled", "type": type(obj).__name__})
                    continue
                self._reply(handler(obj))
            except Exception:  # noqa: BLE001 - keep serving; the TM times out on its side
                self.log({"call": "scheduler_error", "trace": traceback.format_exc()[-2000:]})

    def _end(self, req):
        out = self.mgr.end_weight_update(req)
        if out.success and self.model.loaded:
            from rollout_bridge.core.weights import state_digest

            self.log({"call": "served", "body": {
                "version": self.tm.config_value("weight_version"),
                "digest": state_digest(self.model.loaded.items()), "receiver": "sglang"}})
        return out

    def _reply(self, out):
        if out is None:
            return
        from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

        out = msgpack_decode(msgpack_encode(out))

        async def deliver():
            self.tm._result_dispatcher(out)
            self.tm.last_receive_tstamp = time.time()

        asyncio.run_coroutine_threadsafe(deliver(), self.loop).result()

    def _generate(self, reqs):
        from sglang.srt.managers.io_struct import (
            BatchTokenIDOutput,
            msgpack_decode,
            msgpack_encode,
        )

        rows = [self._one(r) for r in reqs]
        for r, x in zip(reqs, rows):
            if "ragged" in r.rid:  # a shorter top-K row every third position
                for q in range(0, len(x["output_top_logprobs_val"]), 3):
                    x["output_top_logprobs_val"][q] = x["output_top_logprobs_val"][q][:-1]
                    x["output_top_logprobs_idx"][q] = x["output_top_logprobs_idx"][q][:-1]
            self.captured[r.rid] = {"arrays": x, "logprob_start_len": r.logprob_start_len,
                                    "top_logprobs_num": r.top_logprobs_num,
                                    "input_ids": list(r.input_ids)}
        fields = {f.name for f in __import__("msgspec").structs.fields(BatchTokenIDOutput)}
        n = len(rows)
        values = {"rids": [r.rid for r in reqs], "finished_reasons": [x["finish"] for x in rows],
                  "decoded_texts": [""] * n,
                  "decode_ids": [array.array("q", x["ids"]) for x in rows],
                  "read_offsets": [0] * n,
                  "output_ids": [array.array("q", x["ids"]) for x in rows],
                  "skip_special_tokens": [True] * n, "spaces_between_special_tokens": [True] * n,
                  "no_stop_trim": [False] * n,
                  "prompt_tokens": [len(r.input_ids) for r in reqs], "reasoning_tokens": [0] * n,
                  "completion_tokens": [len(x["ids"]) for x in rows], "cached_tokens": [0] * n,
                  "retraction_counts": [0] * n}
        for key in ("input_token_logprobs_val", "input_token_logprobs_idx",
                    "output_token_logprobs_val", "output_token_logprobs_idx",
                    "input_top_logprobs_val", "input_top_logprobs_idx",
                    "output_top_logprobs_val", "output_top_logprobs_idx"):
            values[key] = [x[key] for x in rows]
        kwargs = {k: v for k, v in values.items() if k in fields}
        for f in __import__("msgspec").structs.fields(BatchTokenIDOutput):
            if f.name not in kwargs and f.required:
                kwargs[f.name] = None
        out = msgpack_decode(msgpack_encode(BatchTokenIDOutput(**kwargs)))

        async def deliver():
            await self.tm._handle_batch_output(out)
            self.tm.last_receive_tstamp = time.time()

        asyncio.run_coroutine_threadsafe(deliver(), self.loop).result()

    def _one(self, req) -> dict:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        sp = req.sampling_params
        ids_in = list(req.input_ids)
        k = int(req.top_logprobs_num or 0)
        if "*" in self.aborted or req.rid in self.aborted:
            return self._empty(FINISH_ABORT("Aborted by AbortReq.").to_json())
        greedy = sp.top_k == 1
        params = {"temperature": 0.0 if greedy else float(sp.temperature),
                  "max_new_tokens": int(sp.max_new_tokens),
                  "stop_token_ids": sorted(sp.stop_token_ids or [])}
        x = self._empty(None)
        if params["max_new_tokens"] > 0:
            saved = self.engine.top_logprobs
            self.engine.top_logprobs = k
            try:
                s = self.engine.generate([ids_in], params, n=1).samples[0]
            finally:
                self.engine.top_logprobs = saved
            out_ids = s.response_ids.tolist()
            x["ids"] = out_ids
            x["output_token_logprobs_val"] = s.behavior_logprob.tolist()
            x["output_token_logprobs_idx"] = out_ids
            if k:
                x["output_top_logprobs_val"] = [r[:k] for r in s.support_logprobs.tolist()]
                x["output_top_logprobs_idx"] = [r[:k] for r in s.support_ids.tolist()]
            if s.finish_reason == "stop":
                x["finish"] = {"type": "stop", "matched": out_ids[-1]}
            else:
                x["finish"] = {"type": "length", "length": len(out_ids)}
        else:
            x["finish"] = {"type": "length", "length": 0}
        start = req.logprob_start_len
        if req.return_logprob and 0 <= start < len(ids_in):
            lp = self.engine.score(ids_in, 1.0)  # untempered, row q predicts token q + 1
            pos = range(start + 1, len(ids_in))
            x["input_token_logprobs_val"] = [None] + [float(lp[q - 1, ids_in[q]]) for q in pos]
            x["input_token_logprobs_idx"] = [ids_in[start]] + [ids_in[q] for q in pos]
            if k:
                tops = [torch.topk(lp[q - 1], k) for q in pos]
                x["input_top_logprobs_val"] = [None] + [t.values.tolist() for t in tops]
                x["input_top_logprobs_idx"] = [None] + [t.indices.tolist() for t in tops]
        return x

    @staticmethod
    def _empty(finish) -> dict:
        return {"finish": finish, "ids": [], "output_token_logprobs_val": [],
                "output_token_logprobs_idx": [], "output_top_logprobs_val": [],
                "output_top_logprobs_idx": [], "input_token_logprobs_val": [],
                "input_token_logprobs_idx": [], "input_top_logprobs_val": [],
                "input_top_logprobs_idx": []}


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
