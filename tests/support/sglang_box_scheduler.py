"""The sglang box's CPU stand-in for sglang's scheduler process (tests/support/sglang_box.py).

`CpuScheduler` receives what the real TokenizerManager dispatches (decoded from the zmq wire by
sglang's own msgpack_decode, `_SchedulerSocket`), answers generate requests from `LocalEngine`
over TinyLM through the TM's own output handlers, and drives sglang's real weight-update
manager and model-runner `WeightUpdater` on a `TinyModel` (TinyLM with SGLang's
`load_weights(named_tensors)` model API). Imports sglang lazily: loaded by the box inside an
sglang API env.
"""

from __future__ import annotations

import array
import asyncio
import queue
import threading
import time
import traceback

import torch

from megatron_pdm.netutil import free_port


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
