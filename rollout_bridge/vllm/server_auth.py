"""vLLM API-server middleware: the API key on every route (vLLM 0.32.0 - 0.33.x).

The API server process loads ``BearerAuthEverywhereMiddleware`` with ``--middleware
<module>.BearerAuthEverywhereMiddleware``; the worker extension (weight sync inside the worker
processes) is worker_ext.py. Like it, this file imports nothing from this repository: the vLLM
launcher (megatron_pdm/train/rollout/vllm_server/process.py) copies both into a directory of their
own on the server's ``PYTHONPATH`` (worker_ext.py's docstring says why).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any


class BearerAuthEverywhereMiddleware:
    """ASGI middleware for the API server process: require the API key on every route.

    vLLM's own ``--api-key`` check guards only paths starting with ``/v1``, ``/v2``,
    ``/inference`` or ``/cohere`` (vllm/entrypoints/serve/middleware/authenticate.py ~l.11, ~l.59),
    so with ``VLLM_SERVER_DEV_MODE=1`` the dev/RL routes (``/collective_rpc``, ``/pause``,
    ``/resume``, ``/update_weight_version``, ``/weight_checker``, ``/abort_requests``, ...) are open
    to anyone who can reach the port. Load with ``--middleware
    <module>.BearerAuthEverywhereMiddleware`` (vllm/entrypoints/serve/middleware/register.py ~l.65,
    instantiated with the app only). The token is ``VLLM_API_KEY``, which vLLM's own check also
    reads when ``--api-key`` is absent (register.py ~l.33), so the key stays out of the process
    list; paths in ``PDM_VLLM_OPEN_PATHS`` (comma-separated, default ``/health``) stay open.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        token = os.environ.get("VLLM_API_KEY", "")
        if not token:
            raise RuntimeError("BearerAuthEverywhereMiddleware needs VLLM_API_KEY in the env")
        self._hashes = [hashlib.sha256(token.encode()).digest()]
        self._open = {p for p in os.environ.get("PDM_VLLM_OPEN_PATHS", "/health").split(",") if p}

    def _authorized(self, scope: dict) -> bool:
        import secrets

        for key, value in scope.get("headers") or []:
            if key.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                digest = hashlib.sha256(token.encode()).digest()
                ok = False
                for h in self._hashes:
                    ok |= secrets.compare_digest(digest, h)
                return ok
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path not in self._open and not self._authorized(scope):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b'{"error":"Unauthorized"}'
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
