"""Start-up checks and weight-version reads of the vLLM client: `VLLMControl`.

What: `check_server` (health, key, served model, the vLLM release against versions.py's range,
dev-route guard, worker facts: logprobs mode, vocabulary, max-logprobs), the weight version
(`/weight_info`) and the served digests, over the transport `VLLMHTTP` (http.py) it is given;
everything it reads is a constructor argument.

Security: vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py l.11, l.59); `check_server` probes a dev route
without the key: a server whose dev routes answer without it is refused unless it is on a
loopback address or `allow_insecure_dev_routes=True`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import urllib.parse

from rollout_bridge.core.engine import AttemptError, run_sync
from rollout_bridge.core.types import EngineMismatchError
from rollout_bridge.vllm.http import VLLMHTTP
from rollout_bridge.vllm.versions import (
    UnsupportedVLLMVersion,
    check_vllm_version,
    supported_text,
)

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
    """Start-up checks and weight-version reads (see module docstring).

    Args:
        http: The transport.
        model: Served model name (None: the server's only model, found by `check_server`).
        top_logprobs: K the client asks for (checked against the server's --max-logprobs).
        vocab_size: Expected vocabulary (None: unchecked).
        allow_insecure_dev_routes: Accept a non-loopback server whose dev routes answer without
            the API key.

    Attributes:
        known_version: The weight version last seen on (or pushed to) the server.
        server_facts: The workers' facts from the last `check_server`.
        dev_routes_guarded: Whether the dev routes refused a request without the key.
        vllm_version: The server's `GET /version`, from the last `check_server`.
    """

    def __init__(self, http: VLLMHTTP, *, model: str | None = None, top_logprobs: int = 20,
                 vocab_size: int | None = None, allow_insecure_dev_routes: bool = False):
        self.http = http
        self.model = model
        self.top_logprobs = int(top_logprobs)
        self.vocab_size = vocab_size
        self.allow_insecure_dev_routes = allow_insecure_dev_routes
        self.known_version: str | None = None
        self.server_facts: list[dict] | None = None
        self.dev_routes_guarded: bool | None = None
        self.vllm_version: str | None = None

    # ------------------------------------------------------------------ start-up checks

    def check_server(self) -> dict:
        """Health, API key, served model, dev-route guard, worker extension and its facts.

        Returns:
            {"model", "max_model_len", "vllm_version", "weight_version", "dev_routes_guarded",
            "facts"}.

        Raises:
            EngineMismatchError: Unhealthy server, rejected key, unknown model, a vLLM release
                outside rollout_bridge/vllm/versions.py's range (`UnsupportedVLLMVersion`), dev
                mode off, open dev routes on a non-loopback server, no worker extension, a
                logprobs mode other than processed_logprobs, or another vocabulary.
        """
        return run_sync(self.acheck_server())

    async def acheck_server(self) -> dict:
        async with self.http.session() as s:
            try:
                await self.http.request(s, "GET", "/health", timeout=30)
            except AttemptError as exc:
                raise EngineMismatchError(f"{self.http.base_url} is not healthy: {exc}") from None
            try:
                _, models = await self.http.request(s, "GET", "/v1/models", timeout=60)
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
            self.vllm_version = await self._check_version(s)
            status, _ = await self.http.request(s, "GET", "/is_paused", ok=(), timeout=60)
            if status == 200:  # dev mode on; does the route answer without the key too?
                status, _ = await self.http.request(s, "GET", "/is_paused", auth=False, ok=(),
                                                timeout=60)
            if status == 404:
                raise EngineMismatchError(
                    "the server's dev routes are missing (/is_paused 404): start it with "
                    "VLLM_SERVER_DEV_MODE=1 (weight sync uses /collective_rpc, /pause, "
                    "/update_weight_version)")
            self.dev_routes_guarded = status == 401
            if not self.dev_routes_guarded:
                msg = (f"{self.http.base_url}: vLLM dev routes (/collective_rpc, /pause, ...) "
                       "answer without the API key (vLLM's --api-key guards only /v1, /v2, "
                       "/inference, /cohere); load rollout_bridge/vllm/worker_ext.py's "
                       "BearerAuthEverywhereMiddleware (--middleware)")
                if not (is_loopback_url(self.http.base_url) or self.allow_insecure_dev_routes):
                    raise EngineMismatchError(msg + ", or pass allow_insecure_dev_routes=True "
                                              "(rollout.vllm.allow_insecure_dev_routes) if the "
                                              "network is trusted")
                logger.warning("%s; accepted: loopback address or explicit opt-in", msg)
            try:
                facts = await self.http.rpc(s, "pdm_server_facts")
            except AttemptError as exc:
                raise EngineMismatchError(
                    f"worker extension not reachable ({exc}); start the server with "
                    "--worker-extension-cls <module>.VLLMWeightSyncExtension "
                    "(rollout_bridge/vllm/worker_ext.py)") from None
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
            version = await self.aweight_version(s)
        return {"model": self.model, "max_model_len": served[self.model].get("max_model_len"),
                "vllm_version": self.vllm_version, "weight_version": version,
                "dev_routes_guarded": self.dev_routes_guarded, "facts": facts}

    async def _check_version(self, session) -> str:
        """`GET /version` against the supported range (rollout_bridge/vllm/versions.py)."""
        try:
            _, out = await self.http.request(session, "GET", "/version", timeout=30)
        except AttemptError as exc:
            raise UnsupportedVLLMVersion(
                f"{self.http.base_url}: the vLLM version cannot be read ({exc}); the bridge "
                f"supports vLLM {supported_text()}") from None
        found = out.get("version") if isinstance(out, dict) else None
        check_vllm_version(found, f"{self.http.base_url} (GET /version)")
        return str(found)

    async def ais_paused(self, session) -> bool:
        """`GET /is_paused` (False when it cannot be read)."""
        try:
            _, out = await self.http.request(session, "GET", "/is_paused", timeout=30)
        except AttemptError:
            return False
        return isinstance(out, dict) and out.get("is_paused") is True

    async def await_resumed(self, session, wait_s: float) -> bool:
        """Polls /is_paused for up to `wait_s`; True once the server is not paused."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while await self.ais_paused(session):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            await asyncio.sleep(min(0.2, left))
        return True

    async def aweight_version(self, session) -> str:
        _, out = await self.http.request(session, "GET", "/weight_info", timeout=60)
        return str(out.get("weight_version"))

    def weight_version(self) -> str:
        """The server's current weight version (`GET /weight_info`)."""
        async def run():
            async with self.http.session() as s:
                return await self.aweight_version(s)

        return run_sync(run())

    def served_digest(self) -> list[dict]:
        """Per worker: digests of the served parameters and of the last loaded blob."""
        async def run():
            async with self.http.session() as s:
                return await self.http.rpc(s, "pdm_weights_digest")

        return run_sync(run())
