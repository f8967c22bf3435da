"""HTTP plumbing shared by the SGLang client modules: servers, the API key, control requests.

What: `SGLangHTTP`, the transport the SGLang client's parts share (`SGLangControl`,
`SGLangWeightSync`, `SGLangEngine` hold one), keeps the list of server base URLs and the API key,
sends control requests (one server or all of them concurrently) and turns every non-2xx answer
into an error that names the server, the route and SGLang's own message. `ROUTES` lists every
(method, path) the client calls; CI checks each one against the route table of the installed
sglang package (tests/rollout_bridge/sglang, marker sglang_api), so a route that does not exist
in a supported release cannot
be used.

API key (SGLang `--api-key`): sent as `Authorization: Bearer <key>` on every request, which is
what SGLang's middleware checks (sglang/srt/utils/auth.py, 0.5.22/0.5.23). The key is held in
the bridge's one `ApiKey` type (rollout_bridge/core/apikey.py: redacted repr and str, read from an
environment variable or a file by `read_api_key`) and never written to a log line or an error
message.

Error shapes SGLang answers with (docs/engines.md, SGLang): a body that does not parse into the
request class -> 400 `{"object": "error", "message": ...}`; a /generate contract violation ->
400 `{"error": "<text>"}`; a ValueError in the tokenizer manager -> 400 `{"error": {"message":
...}}`; a failed weight update -> 400 `{"success": false, "message": ...}`; missing or wrong key ->
401 `{"error": "Unauthorized"}`; an unknown route -> 404 `{"detail": "Not Found"}`.
`error_message` extracts the text from any of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp

from rollout_bridge.core.apikey import ApiKey
from rollout_bridge.core.decode import MalformedResponseError, loads
from rollout_bridge.core.engine import run_sync

# Every (method, path) the client sends, by purpose. The sglang_api tests check each against the
# installed sglang's HTTP app (both supported versions); tests/support/fake_sglang.py serves them.
ROUTES: dict[str, tuple[str, str]] = {
    "generate": ("POST", "/generate"),
    "health": ("GET", "/health"),
    "model_info": ("GET", "/model_info"),
    "server_info": ("GET", "/server_info"),
    "pause_generation": ("POST", "/pause_generation"),
    "continue_generation": ("POST", "/continue_generation"),
    "begin_weight_update": ("POST", "/begin_weight_update"),
    "end_weight_update": ("POST", "/end_weight_update"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk"),
    "init_weights_update_group": ("POST", "/init_weights_update_group"),
    "update_weights_from_distributed": ("POST", "/update_weights_from_distributed"),
    "destroy_weights_update_group": ("POST", "/destroy_weights_update_group"),
    "update_weights_from_tensor": ("POST", "/update_weights_from_tensor"),
    "flush_cache": ("POST", "/flush_cache"),
    "release_memory_occupation": ("POST", "/release_memory_occupation"),
    "resume_memory_occupation": ("POST", "/resume_memory_occupation"),
}

SUPPORTED_SGLANG = ("0.5.22", "0.5.23")
"""The sglang releases the client is checked against (marker sglang_api, both ends)."""


class SGLangServerError(RuntimeError):
    """A control request failed (HTTP error, unreachable server, refused operation).

    Attributes:
        url: The server. status: HTTP status (None when no answer came). route: "METHOD /path".
    """

    def __init__(self, message: str, *, url: str, route: str, status: int | None = None):
        super().__init__(message)
        self.url, self.route, self.status = url, route, status


def error_message(raw: bytes) -> str:
    """SGLang's error text from any of its error bodies (module docstring), else the raw start."""
    try:
        obj = loads(raw)
    except MalformedResponseError:
        return raw[:300].decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        if err is not None:
            return str(err)[:500]
        for key in ("message", "detail"):
            if key in obj:
                return str(obj[key])[:500]
    return str(obj)[:300]


class SGLangHTTP:
    """Server list, API key and control requests (the transport of the SGLang client's parts).

    Args:
        base_urls: One URL or a list ("http://10.0.0.5:30000"); each a SGLang server, never a
            sglang-router (it does not route the weight-sync and pause endpoints, docs/engines.md).
        api_key: `ApiKey` (or a plain string) sent on every request; None sends none.
        control_timeout_s: Timeout of one control request.
    """

    def __init__(self, base_urls: str | Sequence[str], *, api_key: ApiKey | str | None = None,
                 control_timeout_s: float = 600.0):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("no SGLang server URL given")
        self.base_urls = [u.rstrip("/") for u in urls]
        if len(set(self.base_urls)) != len(self.base_urls):
            raise ValueError(f"duplicate SGLang server URLs in {self.base_urls}")
        self._api_key = ApiKey.of(api_key)
        self.control_timeout_s = float(control_timeout_s)

    @property
    def base_url(self) -> str:
        """The first server (single-server use)."""
        return self.base_urls[0]

    @property
    def has_api_key(self) -> bool:
        return self._api_key is not None

    def headers(self) -> dict[str, str]:
        """The request headers (the API key's, if any)."""
        return self._api_key.header() if self._api_key is not None else {}

    async def arequest(self, session: aiohttp.ClientSession, url: str, name: str,
                       body: dict | None = None) -> Any:
        """One control request; the decoded JSON answer (None for an empty body/`null`)."""
        method, path = ROUTES[name]
        route = f"{method} {path}"
        try:
            async with session.request(method, url + path, json=body,
                                       headers=self.headers()) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise SGLangServerError(f"{url}: {route}: no answer within {self.control_timeout_s} s",
                                    url=url, route=route) from None
        except aiohttp.ClientError as exc:
            raise SGLangServerError(f"{url}: {route}: {type(exc).__name__}: {exc}", url=url,
                                    route=route) from None
        if status // 100 != 2:
            hint = " (API key missing or wrong)" if status == 401 else ""
            raise SGLangServerError(f"{url}: {route}: HTTP {status}{hint}: "
                                    f"{error_message(raw)}", url=url, route=route,
                                    status=status)
        if not raw.strip():
            return None
        try:
            return loads(raw)
        except MalformedResponseError:
            return {"text": raw.decode("utf-8", "replace")}

    def session(self, limit: int = 0) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=self.control_timeout_s)
        return aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=limit))

    async def acontrol_all(self, name: str, body: dict | None = None,
                           urls: Sequence[str] | None = None,
                           bodies: Sequence[dict] | None = None) -> list[Any]:
        """`name` on every server concurrently (`bodies`: one body per server); answers in
        server order (the first error is raised after all have answered, so no request is left
        running)."""
        urls = list(urls or self.base_urls)
        bodies = list(bodies) if bodies is not None else [body] * len(urls)
        async with self.session() as session:
            results = await asyncio.gather(*(self.arequest(session, u, name, b)
                                             for u, b in zip(urls, bodies)),
                                           return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def control(self, name: str, body: dict | None = None, url: str | None = None) -> Any:
        """`name` on one server (default: the first)."""
        return self.control_all(name, body, urls=[url or self.base_url])[0]

    def control_all(self, name: str, body: dict | None = None,
                    urls: Sequence[str] | None = None,
                    bodies: Sequence[dict] | None = None) -> list[Any]:
        """`name` on every server (or `urls`), blocking; see `acontrol_all`."""
        return run_sync(self.acontrol_all(name, body, urls, bodies))

    def checked_all(self, name: str, body: dict | None = None, urls: Sequence[str] | None = None,
                    bodies: Sequence[dict] | None = None) -> list[Any]:
        """`control_all`, and a `{"success": false}` answer is an error too."""
        urls = list(urls or self.base_urls)
        outs = self.control_all(name, body, urls=urls, bodies=bodies)
        for url, out in zip(urls, outs):
            if isinstance(out, dict) and out.get("success") is False:
                method, path = ROUTES[name]
                raise SGLangServerError(f"{url}: {method} {path} refused: {out.get('message')}",
                                        url=url, route=f"{method} {path}")
        return outs
