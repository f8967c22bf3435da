"""A real HTTP server that answers like SGLang's, backed by `LocalEngine`, for tests.

What: aiohttp app on 127.0.0.1 (free port) in a background thread, serving exactly the routes
our client uses (`rollout_bridge.sglang.http.ROUTES`, each checked to exist in the installed
sglang 0.5.22/0.5.23 by the sglang_api tests) plus `/get_model_info`; anything else is 404
`{"detail": "Not Found"}` like SGLang's FastAPI app (so `/get_weight_version`, gone since
0.5.21, is 404 here too). Nothing in it is written from memory:
  * response bodies are built by `sglang_format` (SGLang's formatting, compared against the
    installed sglang's TokenizerManager by tests/rollout_bridge/sglang/test_sglang_formatting.py):
    `{"output_ids", "meta_info"}` without "text" (`--skip-tokenizer-init`), prompt-side rows
    starting with a null row at `logprob_start_len`;
  * requests are checked by `sglang_rules` (the same table goes through the real handler in
    the sglang_api tests): 400 with SGLang's three error shapes, 401 `{"error": "Unauthorized"}`
    without the API key (every route but /health, /ready, /metrics), the weight-update session
    (update_weights_from_distributed / _tensor outside begin/end -> 400 `success: false`);
  * weights arrive over a real gloo/NCCL group (`sglang_receiver`: sglang's own WeightUpdater when
    the sglang env is on the path, else its plain-torch restatement), and are loaded into the
    engine's model; `served_state` keeps every tensor as received (what SGLang's
    `model.load_weights` gets), `served_digest()` hashes it.

Why: the client's retry/bookkeeping logic, the parser and the weight sync must be exercised
against real sockets, real timeouts, real malformed bytes and a real broadcast group, without a
GPU.

Faults: `server.fault_fn(body, call_no) -> Fault | None` is called for every /generate request.
`parse_rid` recovers (prompt, sample, attempt) from the client's request ids.

The answers to one item and the fault model: tests/support/fake_sglang_answers.py. The CLI that
the driver tests start as a process: tests/support/fake_sglang_cli.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable

import orjson
import torch
from aiohttp import web

sys.path.insert(0, os.path.dirname(__file__))

import sglang_format as fmt
import sglang_rules as rules
from fake_models import load_named

from rollout_bridge import LocalEngine
from rollout_bridge.sglang.http import ROUTES
from rollout_bridge.core.weights import state_digest

from fake_sglang_answers import Fault, generated, parse_rid, scored  # noqa: F401 (re-exported)


class FakeSGLangServer:
    """See module docstring.

    Args:
        engine: Engine used for generation and scoring.
        model_path: Reported by /model_info.
        api_key: Like SGLang's --api-key (None: no authentication).
        receiver: "auto", "mirror" or "sglang" (sglang_receiver.make_receiver); created on the
            first /init_weights_update_group.
        tp_size: Reported by /server_info (one receiving rank per TP rank; only 1 is served).
    """

    def __init__(self, engine: LocalEngine, model_path: str = "tiny-lm", *,
                 api_key: str | None = None, receiver: str = "auto", tp_size: int = 1):
        self.engine = engine
        self.model_path = model_path
        self.api_key = api_key
        self.receiver_kind = receiver
        self.receiver = None
        self.tp_size = tp_size
        self.fault_fn: Callable[[dict, int], Fault | None] | None = None
        self.tensor_deserializer: Callable[[list[str]], dict] | None = None
        self.calls: list[tuple[str, dict]] = []
        self.num_generate = 0
        # --log-file: every call but /generate is appended (one write of one line) before it
        # is answered, so a client that got its answer finds the call in the log.
        self.call_log_fd: int | None = None
        self._log_lock = threading.Lock()
        self.paused = False
        self.session = rules.Session()
        self.served_state: dict[str, torch.Tensor] = {}
        self.unauthorized: list[str] = []
        self.deterministic_seeds = False
        self.discard_weights = False  # receive weights, neither load nor keep them (benchmarks)
        """Seed every item by (prompt, sample index) instead of arrival order (reproducible
        rollouts under the client's concurrent requests)."""
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake SGLang server did not start")
        return self.url

    async def _start(self) -> None:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._middleware])
        handlers = {"generate": self._generate, "health": self._health,
                    "model_info": self._model_info, "server_info": self._server_info}
        for name, (method, path) in ROUTES.items():
            app.router.add_route(method, path, handlers.get(name, self._control))
        app.router.add_get("/get_model_info", self._model_info)  # deprecated alias in SGLang
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if not rules.auth_ok(request.path, request.method, request.headers, self.api_key):
            self.unauthorized.append(request.path)
            return web.json_response(rules.Rejected("unauthorized", "").body, status=401)
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return web.json_response({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)

    # ------------------------------------------------------------------ endpoints

    async def _health(self, request: web.Request) -> web.Response:
        self._record("health", {})
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        self._record("model_info", {})
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.model_path,
            "tokenizer_path": None, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version(), "load_format": "auto",
            "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": None, "architectures": None})

    async def _server_info(self, request: web.Request) -> web.Response:
        self._record("server_info", {})
        # SGLang's answer is the resolved server args, the API key included
        return web.json_response({"tp_size": self.tp_size, "dp_size": 1, "pp_size": 1,
                                  "api_key": self.api_key, "skip_tokenizer_init": True})

    async def _control(self, request: web.Request) -> web.Response:
        name = request.path.strip("/")
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            return web.json_response(rules.Rejected("pydantic", "invalid JSON").body, status=400)
        self._record(name, body)
        try:
            rules.check_control(name, body)
        except rules.Rejected as rej:
            if rej.shape == "refused":
                return web.json_response({"success": False, "message": rej.message}, status=400)
            return web.json_response(rej.body, status=rej.status)
        loop = asyncio.get_running_loop()
        ok, message, extra = await loop.run_in_executor(None, self._control_sync, name, body)
        if name in ("pause_generation", "continue_generation"):
            verb = "paused" if name == "pause_generation" else "continued"
            return web.json_response({"message": f"Generation {verb} successfully.",
                                      "status": "ok"})
        if name in ("flush_cache", "release_memory_occupation", "resume_memory_occupation"):
            return web.json_response(None)
        return web.json_response({"success": ok, "message": message, **extra},
                                 status=200 if ok else 400)

    def _control_sync(self, name: str, body: dict) -> tuple[bool, str, dict]:
        if name == "pause_generation":
            self.paused = True
        elif name == "continue_generation":
            self.paused = False
        elif name == "begin_weight_update":
            return (*self.session.begin(), {})
        elif name == "end_weight_update":
            ok, msg = self.session.end()
            if ok:
                self._log_served()
            return ok, msg, {}
        elif name == "update_weights_from_disk":
            try:
                with self._lock:
                    from rollout_bridge.core.weights import load_safetensors_dir

                    state = load_safetensors_dir(body["model_path"])
                    self.engine.load_weights_from_disk(body["model_path"],
                                                       body.get("weight_version"))
                    self.served_state = {k: v.clone() for k, v in state.items()}
            except Exception as exc:  # noqa: BLE001 - reported like SGLang does
                return False, f"Failed to update weights: {exc}", {"num_paused_requests": 0}
            return True, "Succeeded to update model weights.", {"num_paused_requests": 0}
        elif name == "init_weights_update_group":
            if self.receiver is None:
                from sglang_receiver import make_receiver

                self.receiver = make_receiver(self.receiver_kind)
            ok, msg = self.receiver.init_group(
                body["master_address"], body["master_port"], body["rank_offset"],
                body["world_size"], body.get("group_name", "weight_update_group"),
                backend=body.get("backend", "nccl"))
            return ok, msg, {}
        elif name == "destroy_weights_update_group":
            if self.receiver is None:
                return False, "The group to be destroyed does not exist.", {}
            return (*self.receiver.destroy(body.get("group_name", "weight_update_group")), {})
        elif name == "update_weights_from_distributed":
            refused = self.session.require("update_weights_from_distributed")
            if refused:
                return (*refused, {})
            try:
                named = self.receiver.receive(body["names"], body["dtypes"], body["shapes"],
                                              body.get("group_name", "weight_update_group"),
                                              body.get("load_format"))
            except Exception as exc:  # noqa: BLE001
                return False, f"Failed to receive weights: {exc}", {}
            return self._load(named, body.get("weight_version"))
        elif name == "update_weights_from_tensor":
            refused = self.session.require("update_weights_from_tensor")
            if refused:
                return (*refused, {})
            if self.tensor_deserializer is None:
                return False, "no deserializer", {}
            named = list(self.tensor_deserializer(body["serialized_named_tensors"]).items())
            return self._load(named, body.get("weight_version"))
        return True, "ok", {}

    def _load(self, named, version) -> tuple[bool, str, dict]:
        if self.discard_weights:
            if version is not None:
                self.engine._version = str(version)
            return True, "Succeeded to update parameter online.", {}
        try:
            with self._lock:
                load_named(self.engine, named)
                for k, v in named:
                    self.served_state[k] = v.clone()
                if version is not None:
                    self.engine._version = str(version)
        except Exception as exc:  # noqa: BLE001
            return False, (f"Failed to update parameter online: {exc}. The full weights of the "
                           "ModelRunner are partially updated. Please discard the whole weights."
                           ), {}
        msg = "Succeeded to update parameter online."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return True, msg, {}

    def _log_served(self) -> None:
        if self.served_state:
            self._record("served", {"version": self.engine.weight_version(),
                                    "digest": state_digest(self.served_state.items()),
                                    "receiver": getattr(self.receiver, "kind", None)})

    def _record(self, name: str, body: dict) -> None:
        with self._log_lock:
            self.calls.append((name, body))
            if self.call_log_fd is not None and name != "generate":
                line = orjson.dumps({"call": name, "body": body},
                                    option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
                os.write(self.call_log_fd, line)

    def served_digest(self) -> str:
        return state_digest(self.served_state.items())

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response(rules.Rejected("pydantic", "invalid JSON").body, status=400)
        self.num_generate += 1
        self._record("generate", body)
        fault = self.fault_fn(body, self.num_generate) if self.fault_fn else None
        fault = fault or Fault()
        while self.paused:
            await asyncio.sleep(0.005)
        if fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault.kind == "http500":
            return web.Response(status=500, text="Internal Server Error")
        if fault.kind == "http400":
            return web.json_response(rules.Rejected("value", "bad request").body, status=400)
        if fault.kind == "drop":
            request.transport.close()
            raise asyncio.CancelledError()
        try:
            rules.check_generate(body, self.engine.vocab_size)
        except rules.Rejected as rej:
            if rej.shape == "stream":
                return web.Response(text=rej.body, content_type="text/event-stream")
            return web.json_response(rej.body, status=rej.status)
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(None, self._answer, body, fault)
        raw = orjson.dumps(out)
        if fault.kind == "malformed":
            raw = raw[: len(raw) // 2]
        if fault.kind == "not_list":
            raw = orjson.dumps(out[0] if isinstance(out, list) else out)
        return web.Response(body=raw, content_type="application/json")

    # ------------------------------------------------------------------ generation

    def _answer(self, body: dict, fault: Fault) -> list | dict:
        ids = body["input_ids"]
        single = not (ids and isinstance(ids[0], list))
        items = [ids] if single else ids
        rids = body.get("rid") or [f"req{i}" for i in range(len(items))]
        rids = [rids] if isinstance(rids, str) else rids
        params = body.get("sampling_params") or {}
        out = []
        for i, prompt in enumerate(items):
            start = time.perf_counter()
            try:  # faulty items are chosen by the client's sample index, else by position
                key = parse_rid(rids[i])[1]
            except ValueError:
                key = i
            if int(params.get("max_new_tokens", 128)) == 0:
                obj = scored(self, prompt, params, body, rids[i])
            else:
                obj = generated(self, prompt, params, body, rids[i], fault, key)
            out.append(fmt.response_object(obj[0], obj[1],
                                           e2e_latency=time.perf_counter() - start,
                                           sent_ts=time.time()))
        return out[0] if single else out
