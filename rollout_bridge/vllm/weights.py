"""Weight sync into a running vLLM server, and recovery from its restarts (`VLLMEngine`'s base).

What: `VLLMWeightSync`, the weight-sync part of the vLLM client (it holds the transport `VLLMHTTP`,
rollout_bridge/vllm/http.py, and the control part `VLLMControl`, rollout_bridge/vllm/control.py):

* Weight sync without disk (`update_weights`): the HF-named state dict is serialised as one
  safetensors blob, base64'd and sent to the worker extension (rollout_bridge/vllm/worker_ext.py)
  through `POST /collective_rpc`, framed by `/pause?mode=wait` (in-flight requests drain, the
  prefix cache is cleared) and `/resume`; every worker's digest of what it loaded must equal the
  trainer's (`canonical_digest`), then `/update_weight_version` sets the version and
  `/weight_info` confirms it. GPU clusters use vLLM's weight-transfer engine instead
  (`init_weight_transfer_engine` / `update_weights_via_transfer`, NCCL; not run on CPU).
* Restarts are never silent: vLLM's completion responses do not say which weights produced them,
  and a restarted server serves its on-disk checkpoint under version "default". The generation
  code (rollout_bridge/vllm/client.py) calls `ensure_server` before every request of a call;
  while the call's `CallState` is suspect (before the first request, after any connection error
  / 5xx / timeout) it runs `_check_restart`: health (waiting up to `recover_timeout_s`), then the
  weight version against the expected one. A restarted server (version mismatch) gets the last
  pushed weights again from the cached blob (`repush_on_restart`, digest-verified); without a
  cached blob the call's remaining samples fail with a "restart" error.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rollout_bridge.core.engine import AttemptError, run_sync
from rollout_bridge.core.types import WeightSyncError
from rollout_bridge.vllm.control import VLLMControl
from rollout_bridge.vllm.http import VLLMHTTP

logger = logging.getLogger(__name__)


class CallState:
    """Shared by the coroutines of one `generate` call (the restart guard)."""

    def __init__(self, expected: str | None):
        self.expected = expected
        self.suspect = True  # the first send waits for a version check
        self.dead: str | None = None
        self.lock = asyncio.Lock()
        self.repushes = 0
        self.checks = 0


class VLLMWeightSync:
    """In-memory weight pushes, the GPU weight-transfer path and the restart guard.

    Args:
        http: The transport.
        control: The control part (weight version; `known_version` is kept there).
        pause_mode: `mode` of /pause around a weight push ("wait": in-flight requests finish).
        recover_timeout_s: How long a restart check waits for the server to come back.
        max_recoveries: Re-pushes after restarts allowed within one `generate` call.
        repush_on_restart: Re-push the cached last weights to a restarted server.
        cache_push_max_bytes: Largest blob kept for re-pushes.
        push_dir: None: the blob travels base64 in the `/collective_rpc` body. A directory the
            server can read (a server on this machine; /dev/shm keeps it in memory): the blob is
            written there and the worker loads the file (`pdm_load_weights_file`), for models
            whose base64 body the server's HTTP layer drops (SmolLM2-135M in bf16, 270 MB:
            the connection was closed mid-upload, "Broken pipe"). Same digest check; the last
            file is kept for a re-push, older ones are deleted.

    Attributes:
        num_repushes: Automatic re-pushes after server restarts (over the engine's lifetime).
        last_push_info: Timings and worker answers of the last push.
    """

    def __init__(self, http: VLLMHTTP, control: VLLMControl, *, pause_mode: str = "wait",
                 recover_timeout_s: float = 0.0, max_recoveries: int = 2,
                 repush_on_restart: bool = True, cache_push_max_bytes: int = 2 << 30,
                 push_dir: str | None = None):
        self.http, self.control = http, control
        self.pause_mode = pause_mode
        self.recover_timeout_s = float(recover_timeout_s)
        self.max_recoveries = int(max_recoveries)
        self.repush_on_restart = repush_on_restart
        self.cache_push_max_bytes = int(cache_push_max_bytes)
        self.push_dir = push_dir
        # ((rpc method, its argument: base64 blob or file path), digest, version)
        self._last_push: tuple[tuple[str, str], str, str] | None = None
        self._lock = threading.Lock()
        self.num_repushes = 0
        self.last_push_info: dict = {}

    # ------------------------------------------------------------------ weight sync

    def update_weights(self, state_dict: Mapping[str, Any], version: str, **_: Any) -> str:
        """`RolloutEngine.update_weights`: push HF-named tensors (no disk), verify, set version.

        Args:
            state_dict: {HF name: tensor}; a complete state dict (a subset must hold whole
                vLLM layers, rollout_bridge/vllm/worker_ext.py), in the dtype to serve.
            version: The new weight version.

        Returns:
            The new version.

        Raises:
            WeightSyncError: The push, the digest check or the version check failed (generation
                is resumed first).
        """
        from safetensors.torch import save

        from rollout_bridge.vllm.worker_ext import canonical_digest

        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        t0 = time.perf_counter()
        blob = save(tensors)
        digest = canonical_digest(tensors)
        payload = self._payload(blob, str(version))
        t1 = time.perf_counter()

        async def run():
            async with self.http.session() as s:
                for attempt in range(self.max_recoveries + 1):
                    try:
                        return await self._apush(s, payload, digest, str(version))
                    except WeightSyncError as exc:
                        # The server died during the push: with recover_timeout_s, wait for it
                        # and push again (idempotent: the same blob and version).
                        if (self.recover_timeout_s <= 0 or attempt == self.max_recoveries
                                or not await self._wait_healthy(s)):
                            raise
                        logger.warning("weight push failed (%s); the server is back: pushing "
                                       "version %s again", exc, version)
                raise AssertionError("unreachable")

        info = run_sync(run())
        info.update(serialize_s=round(t1 - t0, 6), bytes=len(blob),
                    transport="file" if self.push_dir else "base64")
        self.last_push_info = info
        return str(version)

    def _payload(self, blob: bytes, version: str) -> tuple[str, str]:
        """(worker method, argument) carrying `blob`: base64 in the body, or a file's path."""
        if self.push_dir is None:
            return "pdm_load_weights_b64", base64.b64encode(blob).decode("ascii")
        path = os.path.join(self.push_dir, f"pdm-weights-{os.getpid()}-{version}.safetensors")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        return "pdm_load_weights_file", os.path.abspath(path)

    async def _wait_healthy(self, session) -> bool:
        """Polls /health for up to recover_timeout_s; True once it answers 200."""
        deadline = time.monotonic() + self.recover_timeout_s
        while True:
            try:
                await self.http.request(session, "GET", "/health", timeout=10)
                return True
            except AttemptError:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(min(2.0, max(0.1, deadline - time.monotonic())))

    async def _apush(self, session, payload: tuple[str, str], digest: str, version: str
                     ) -> dict:
        t0 = time.perf_counter()
        try:
            await self.http.request(session, "POST", "/pause",
                                params={"mode": self.pause_mode, "clear_cache": "true"})
        except AttemptError as exc:
            raise WeightSyncError(f"vLLM server {self.http.base_url}: pause before the weight push "
                                  f"failed: {exc}") from None
        error: str | None = None
        results: list = []
        try:
            results = await self.http.rpc(session, *payload)
            for i, r in enumerate(results):
                got = r.get("canonical_digest") if isinstance(r, dict) else None
                if got != digest:
                    error = (f"worker {i} loaded tensors with digest {got!r}, the trainer sent "
                             f"{digest!r}")
                    break
            if error is None:
                await self.http.request(session, "POST", "/update_weight_version",
                                    body={"new_version": version})
        except AttemptError as exc:
            error = str(exc)
        finally:
            try:
                await self.http.request(session, "POST", "/resume")
            except AttemptError as exc:
                error = error or f"resume after the weight push failed: {exc}"
        if error is None:
            try:
                got = await self.control.aweight_version(session)
            except AttemptError as exc:
                got, error = None, f"weight version check failed: {exc}"
            if error is None and got != version:
                error = f"server reports weight version {got!r} after pushing {version!r}"
        if error is not None:
            self.control.known_version = None
            raise WeightSyncError(f"vLLM weight push of version {version} failed "
                                  f"({self.http.base_url}): {error}")
        self.control.known_version = version
        nbytes = (len(payload[1]) * 3 // 4 if payload[0] == "pdm_load_weights_b64"
                  else os.path.getsize(payload[1]))
        with self._lock:
            previous = self._last_push
            self._last_push = ((payload, digest, version)
                               if nbytes <= self.cache_push_max_bytes else None)
        stale = [previous[0]] if previous is not None and previous[0] != payload else []
        if self._last_push is None:
            stale.append(payload)  # too large to keep for a re-push
        for method, arg in stale:
            if method == "pdm_load_weights_file":
                with contextlib.suppress(OSError):
                    os.remove(arg)
        load_s = max((r.get("load_s", 0.0) for r in results), default=0.0)
        logger.info("vLLM weights -> version %s (%d tensors, %.2f s, worker load %.3f s)",
                    version, results[0].get("num_tensors", -1), time.perf_counter() - t0, load_s)
        return {"push_s": round(time.perf_counter() - t0, 6), "worker": results,
                "digest": digest, "version": version}

    def init_weight_transfer_engine(self, init_info: dict) -> Any:
        """GPU clusters: `POST /init_weight_transfer_engine` (server started with
        `--weight-transfer-config '{"backend": "nccl"}'`; e.g. NCCLTrainerInitInfo fields
        master_address, master_port, world_size, ...). Not available on CPU."""
        return self.http.control("POST", "/init_weight_transfer_engine",
                                 body={"init_info": init_info})

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
            async with self.http.session() as s:
                await self.http.request(s, "POST", "/pause",
                                    params={"mode": self.pause_mode, "clear_cache": "true"})
                try:
                    await self.http.request(s, "POST", "/start_weight_update")
                    update = asyncio.ensure_future(self.http.request(
                        s, "POST", "/update_weights", body={"update_info": {
                            "names": list(names), "dtype_names": list(dtype_names),
                            "shapes": [list(map(int, x)) for x in shapes]}}))
                    await asyncio.get_running_loop().run_in_executor(None, send_fn)
                    await update
                    await self.http.request(s, "POST", "/finish_weight_update",
                                        body={"weight_version": str(version)})
                finally:
                    await self.http.request(s, "POST", "/resume")
                return await self.control.aweight_version(s)

        try:
            got = run_sync(run())
        except AttemptError as exc:
            raise WeightSyncError(f"weight transfer of version {version} failed: {exc}") from None
        if got != str(version):
            raise WeightSyncError(f"server reports weight version {got!r} after {version!r}")
        self.control.known_version = str(version)
        with self._lock:
            self._last_push = None  # nothing cached to re-push after a restart
        return str(version)

    # ------------------------------------------------------------------ restart guard

    async def ensure_server(self, session, state: CallState) -> AttemptError | None:
        """Blocks sends while the server is suspect; None when a request may be sent."""
        while True:
            if state.dead is not None:
                return AttemptError("restart", state.dead, retryable=False)
            if not state.suspect:
                return None
            async with state.lock:
                if state.dead is not None or not state.suspect:
                    continue
                await self._check_restart(session, state)
                if state.suspect and state.dead is None:
                    return AttemptError("connection", f"{self.http.base_url} is unreachable "
                                         "(health check failed)")

    async def _check_restart(self, session, state: CallState) -> None:
        """Health (waiting up to recover_timeout_s), then the weight version; re-push if needed.

        Leaves `state.suspect` True if the server stays unreachable, sets `state.dead` when it
        came back with other weights that cannot be restored.
        """
        state.checks += 1
        deadline = time.monotonic() + self.recover_timeout_s
        while True:
            try:
                await self.http.request(session, "GET", "/health", timeout=10)
                version = await self.control.aweight_version(session)
                break
            except AttemptError:
                if time.monotonic() >= deadline:
                    return
                await asyncio.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
        if state.expected is None:
            state.expected = version  # nothing pushed yet: adopt what the server serves
            self.control.known_version = version
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
                       "re-pushing the cached weights", self.http.base_url, version, state.expected)
        try:
            await self._apush(session, *cached)
        except WeightSyncError as exc:
            state.dead = f"re-push after a restart failed: {exc}"
            return
        state.repushes += 1
        self.num_repushes += 1
        state.suspect = False
