"""Rollouts from an inference server driven by global rank 0, shared by every server engine.

Every rank of the trainer needs the same `RolloutBatch`, but only rank 0 talks to the server: it
calls the engine client (SGLang, vLLM: `rollout_bridge`), checks that every sample was generated
by the weight version the trainer expects, and broadcasts the batch (`broadcast_object_list`);
each data-parallel rank then trains on its slice. A failure on rank 0 is broadcast too, so every
rank raises instead of hanging in the next collective.

Generation can run in the background (`submit` / `collect`): on rank 0 the client call runs in a
thread while the trainer keeps training, which is how rollouts overlap with training
(`rollout.overlap`). `submit` records the version the server holds at that moment; `collect`
joins the thread, checks the batch against that version and broadcasts it. Weight pushes must
not run while a generation is in flight (`sync` refuses).

A `ServerRollout` is composed with its engine's glue (sglang.py `SGLangGlue`, vllm.py
`VLLMGlue`), which provides the client (`make_client`, rank 0 only), the start-up check
(`check_server`, rank 0), the push (`push`, collective: gathering the weights involves every rank)
and what of the client's state a checkpoint or an evaluation keeps (`client_state`); everything
else, the same for every server engine, is here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

import torch.distributed as dist

from rollout_bridge.core.types import RolloutBatch, check_weight_version

logger = logging.getLogger(__name__)


def capture(fn: Callable[[], Any], failure_log: str) -> tuple[str, Any]:
    """Rank 0: ("ok", fn()) or ("error", "<type>: <message>") (logged with `failure_log`), the
    outcome `share_from_rank0` hands to every rank."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by share_from_rank0
        logger.exception(failure_log)
        return ("error", f"{type(exc).__name__}: {exc}")


def share_from_rank0(outcome: tuple[str, Any] | None) -> Any:
    """Collective: rank 0's `capture` outcome (None elsewhere) -> its value on every rank, or a
    RuntimeError naming rank 0's error on every rank."""
    box = [outcome]
    # Object broadcast from rank 0: the result (or the error text) reaches every rank.
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"rollout server call failed on rank 0: {value}")
    return value


class PendingRollout:
    """A generation started by `ServerRollout.submit` (a thread on rank 0, nothing elsewhere)."""

    def __init__(self, expected_version: str | None):
        self.expected_version = expected_version
        self.thread: threading.Thread | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.started = time.time()


class EngineGlue(Protocol):
    """The engine-specific part of a `ServerRollout` (sglang.py, vllm.py)."""

    name: str
    last_push: dict

    def make_client(self) -> Any:
        """Rank 0: the engine client (a `rollout_bridge` engine)."""

    def check_server(self, client) -> Any:
        """Rank 0: start-up checks against the server (raise on a mismatch); a summary."""

    def push(self, rollout: ServerRollout, version: str) -> None:
        """Collective: push the trainer's current weights (`rollout.module()`) as `version`,
        rank 0's part through `rollout.client` / `rollout.on_rank0`."""

    def client_state(self, client) -> Any:
        """Rank 0: what seeds the client's next requests (None: the server seeds its own)."""

    def load_client_state(self, client, state) -> None:
        """Rank 0: restores `client_state`'s value."""


class ServerRollout:
    """Rank 0 drives a server engine through its glue; every rank gets the same batches."""

    def __init__(self, cfg, arch, trainer_module_fn: Callable, glue: EngineGlue):
        self.cfg = cfg
        self.arch = arch
        self.glue = glue
        self.module = trainer_module_fn
        self.version: str | None = None
        self.last_sync_s = 0.0
        self._in_flight: PendingRollout | None = None
        self.client = glue.make_client() if dist.get_rank() == 0 else None
        # what the server said at start-up (the glue's summary), the same on every rank
        self.server_info = self.on_rank0(lambda: glue.check_server(self.client))

    @property
    def last_push(self) -> dict:
        """The last push's facts (bytes, seconds, digest, ...), as the glue recorded them."""
        return self.glue.last_push

    # ------------------------------------------------------------------ helpers

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Runs fn on rank 0 and broadcasts its result (or its exception) to every rank."""
        outcome = capture(fn, "rank 0 rollout-server call failed") if dist.get_rank() == 0 else None
        return share_from_rank0(outcome)

    # ------------------------------------------------------------------ rollouts

    def submit(self, prompt_ids: list[list[int]], params: dict, n: int) -> PendingRollout:
        """Starts a generation (rank 0: in a background thread). Not collective."""
        if self._in_flight is not None:
            raise RuntimeError("a generation is already in flight; collect it first")
        pending = PendingRollout(self.version)
        if dist.get_rank() == 0:
            def run():
                try:
                    pending.result = self.client.generate(prompt_ids, params, n=n)
                except BaseException as exc:  # noqa: BLE001 - re-raised by collect
                    pending.error = exc

            pending.thread = threading.Thread(target=run, name="rollout", daemon=True)
            pending.thread.start()
        self._in_flight = pending
        return pending

    def collect(self, pending: PendingRollout) -> RolloutBatch:
        """Collective: waits for `pending` and hands its batch to every rank."""
        if pending is not self._in_flight:
            raise RuntimeError("collect() got a generation that is not the one in flight")
        self._in_flight = None

        def finish():
            pending.thread.join()
            if pending.error is not None:
                raise pending.error
            batch = pending.result
            if pending.expected_version is not None:
                check_weight_version(batch, pending.expected_version)
            return batch

        return self.on_rank0(finish)

    def generate(self, prompt_ids: list[list[int]], params: dict, n: int) -> RolloutBatch:
        """Collective: submit + collect."""
        return self.collect(self.submit(prompt_ids, params, n))

    # ------------------------------------------------------------------ weight sync

    def sync(self, version: str) -> None:
        """Collective: push the current weights as `version` (no generation may be in flight)."""
        if self._in_flight is not None:
            raise RuntimeError("weight sync while a generation is in flight: collect it first")
        t0 = time.time()
        self.glue.push(self, str(version))
        self.version = str(version)
        self.last_sync_s = time.time() - t0
        logger.info("weight sync to version %s: %.2f s", version, self.last_sync_s)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        state = {"version": self.version}
        if self.client is not None:  # rank 0: e.g. vLLM's request-seed counter (exact resume)
            client = self.glue.client_state(self.client)
            if client is not None:
                state["client"] = client
        return state

    def sampling_state(self):
        """What seeds the next requests (rank 0's client state; None elsewhere)."""
        return None if self.client is None else self.glue.client_state(self.client)

    def restore_sampling_state(self, state) -> None:
        if self.client is not None and state is not None:
            self.glue.load_client_state(self.client, state)

    def load_state_dict(self, state: dict) -> None:
        # After a resume the trainer pushes its restored weights again (same version string).
        self.version = state.get("version")
        if self.client is not None and state.get("client") is not None:
            self.glue.load_client_state(self.client, state["client"])
