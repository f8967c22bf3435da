"""Weight sync to SGLang servers: disk, NCCL/gloo broadcast (`update_weights_from_distributed`),
and in-memory tensors, always framed the way SGLang's own code requires.

`SGLangWeightSync`, the weight-sync part of the SGLang client (it holds the transport `SGLangHTTP`
and the control part `SGLangControl`; every call goes to every server; docs/engines.md, SGLang):
  * disk: pause -> POST /update_weights_from_disk {model_path, weight_version} -> continue ->
    every server's /model_info must report the new version. No session is needed for disk.
  * distributed and tensor updates must run inside a weight-update session, or the scheduler
    answers `success: false` ("must run between begin_weight_update() and end_weight_update()",
    sglang/srt/managers/scheduler_components/weight_updater.py:187-199 (0.5.23)). The session is
    `weight_update_session(version)`: pause -> begin_weight_update -> (updates) ->
    end_weight_update -> continue -> version check. End and continue are sent even when an update
    failed; every failure is raised afterwards as `WeightSyncError`.

The trainer side of the broadcast path (`join_weight_update_group`, `DistributedWeightSender`)
is rollout_bridge/sglang/broadcast.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from rollout_bridge.core.types import WeightSyncError
from rollout_bridge.sglang.control import SGLangControl
from rollout_bridge.sglang.http import SGLangHTTP, SGLangServerError

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "flattened_bucket")


def dtype_name(dtype: torch.dtype | str) -> str:
    """"bfloat16" for torch.bfloat16 (SGLang does `getattr(torch, name)` on the server)."""
    return str(dtype).replace("torch.", "")


class SGLangWeightSync:
    """Weight-update endpoints of SGLang servers (module docstring).

    Args:
        http: The transport (server list, API key, control requests).
        control: The control part (pause / continue, session, versions, pause_mode).
    """

    def __init__(self, http: SGLangHTTP, control: SGLangControl):
        self.http, self.control = http, control

    # ------------------------------------------------------------------ framing

    def _verify_version(self, version: str, what: str) -> str:
        versions = self.control.weight_versions()
        bad = [(u, v) for u, v in zip(self.http.base_urls, versions) if v != version]
        if bad:
            raise WeightSyncError(f"after {what} " + ", ".join(
                f"{u} reports weight_version {v!r}" for u, v in bad) + f", expected {version!r}")
        self.control.known_version = version
        return version

    def _pause(self) -> None:
        try:
            self.control.pause_generation()
        except SGLangServerError as exc:
            with contextlib.suppress(SGLangServerError):
                self.control.continue_generation()
            raise WeightSyncError(f"pause_generation failed: {exc}") from exc

    @contextlib.contextmanager
    def weight_update_session(self, version: str, what: str = "weight update"):
        """pause -> begin -> (body) -> end -> continue -> every server reports `version`.

        End and continue run even when the body raised; any failure (the body's first) is
        raised as `WeightSyncError` after generation has resumed.
        """
        self._pause()
        errors: list[BaseException] = []
        opened = False
        try:
            self.control.begin_weight_update()
            opened = True
            yield
        except Exception as exc:  # noqa: BLE001 - generation must resume first
            errors.append(exc)
        finally:
            if opened:
                try:
                    self.control.end_weight_update()
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            try:
                self.control.continue_generation()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            first = errors[0]
            if isinstance(first, WeightSyncError):
                raise first
            raise WeightSyncError(f"{what} failed: {first}") from first
        self._verify_version(str(version), what)

    # ------------------------------------------------------------------ disk

    def update_weights_from_disk(self, model_path: str, weight_version: str, *,
                                 load_format: str | None = None, flush_cache: bool | None = None,
                                 **extra: Any) -> str:
        """Every server loads a HF safetensors directory (pause -> update -> continue -> check).

        Args:
            model_path: Directory readable by every server (`weights.save_hf_safetensors`).
            weight_version: Recorded by the servers and returned in every later response.
            load_format: Optional SGLang load format.
            flush_cache: Flush the radix cache (KV of the old weights); default: only when
                pause_mode is "abort" (with queued requests SGLang refuses the flush and
                reports the whole update as failed).
            **extra: Further fields of UpdateWeightFromDiskReqInput.

        Returns:
            The new version.

        Raises:
            WeightSyncError: a server refused or failed, or reports another version afterwards.
        """
        version = str(weight_version)
        body = {"model_path": model_path, "weight_version": version,
                "flush_cache": self.flush(flush_cache), "abort_all_requests": False, **extra}
        if load_format is not None:
            body["load_format"] = load_format
        self._pause()
        error: BaseException | None = None
        try:
            self.http.checked_all("update_weights_from_disk", body)
        except Exception as exc:  # noqa: BLE001 - generation must resume first
            error = exc
        finally:
            try:
                self.control.continue_generation()
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise WeightSyncError(f"update_weights_from_disk failed: {error}") from error
        self._verify_version(version, "update_weights_from_disk")
        logger.info("weights updated from disk to version %s on %d server(s)", version,
                    len(self.http.base_urls))
        return version

    def update_weights(self, model_path: str, version: str, **kwargs: Any) -> str:
        """`RolloutEngine.update_weights`: `update_weights_from_disk(model_path, version)`."""
        return self.update_weights_from_disk(model_path, version, **kwargs)

    def flush(self, flush_cache: bool | None) -> bool:
        """Whether a sync flushes the radix cache: `flush_cache`, default only when pause_mode is
        "abort" (with queued requests SGLang refuses the flush)."""
        return (self.control.pause_mode == "abort") if flush_cache is None else bool(flush_cache)

    # ------------------------------------------------------------------ distributed

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  group_name: str, *, rank_offsets: list[int], world_size: int,
                                  backend: str = "nccl",
                                  join: Callable[[], Any] | None = None) -> Any:
        """POST /init_weights_update_group to every server (server i joins as ranks
        rank_offsets[i] + tp_rank) while `join()` (the trainer joining as rank 0) runs here: the
        servers' requests return only once every rank has joined.

        Returns:
            What `join()` returned (the trainer's process group).
        """
        bodies = [{"master_address": master_address, "master_port": int(master_port),
                   "rank_offset": int(off), "world_size": int(world_size),
                   "group_name": group_name, "backend": backend} for off in rank_offsets]
        # Both sides block until every rank has joined. If the servers refuse, the trainer's
        # rendezvous can only time out, so it runs in a daemon thread that is not waited for.
        box: dict[str, Any] = {}
        done = threading.Event()

        def run_join():
            try:
                box["value"] = join() if join is not None else None
            except BaseException as exc:  # noqa: BLE001 - reported below
                box["error"] = exc
            done.set()

        joiner = threading.Thread(target=run_join, name="weight-group-join", daemon=True)
        joiner.start()
        answered: dict[str, Any] = {}
        servers_done = threading.Event()

        def run_servers():
            try:
                answered["value"] = self.http.checked_all("init_weights_update_group",
                                                          bodies=bodies)
            except BaseException as exc:  # noqa: BLE001 - reported below
                answered["error"] = exc
            servers_done.set()

        threading.Thread(target=run_servers, name="weight-group-init", daemon=True).start()
        # whichever side fails first ends the wait (the other can then only time out)
        while not servers_done.wait(0.05):
            if done.is_set() and "error" in box:
                raise WeightSyncError(f"joining the weight-update group failed: "
                                      f"{box['error']}") from box["error"]
        if "error" in answered:
            raise WeightSyncError(f"init_weights_update_group failed: {answered['error']}") \
                from answered["error"]
        done.wait()
        if "error" in box:
            raise WeightSyncError(f"joining the weight-update group failed: {box['error']}") \
                from box["error"]
        return box.get("value")

    def distributed_update_body(self, names: list[str], dtypes: list, shapes: list,
                                group_name: str, *, load_format: str | None,
                                weight_version: str | None, flush_cache: bool) -> dict:
        """Body of one /update_weights_from_distributed request (validated against
        UpdateWeightsFromDistributedReqInput of the installed sglang in CI)."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        return {"names": list(names), "dtypes": [dtype_name(d) for d in dtypes],
                "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name,
                "flush_cache": bool(flush_cache), "abort_all_requests": False,
                "weight_version": None if weight_version is None else str(weight_version),
                "load_format": load_format}

    def post_distributed_update(self, body: dict) -> None:
        """POST one /update_weights_from_distributed to every server (blocks until each has
        received and loaded the bucket); `success: false` -> SGLangServerError."""
        self.http.checked_all("update_weights_from_distributed", body)

    def update_weights_from_distributed(self, names: list[str], dtypes: list,
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str, *, broadcast_fn: Callable[[], None],
                                        load_format: str | None = None,
                                        flush_cache: bool | None = None) -> str:
        """One bucket, the whole flow: session, the request on every server while
        `broadcast_fn()` broadcasts the tensors from rank 0 here. (The driver uses
        `DistributedWeightSender`, which streams many buckets through one session.)"""
        body = self.distributed_update_body(names, dtypes, shapes, group_name,
                                            load_format=load_format,
                                            weight_version=weight_version,
                                            flush_cache=self.flush(flush_cache))
        with self.weight_update_session(str(weight_version), "update_weights_from_distributed"):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(self.post_distributed_update, body)
                broadcast_fn()
                fut.result()
        return str(weight_version)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """POST /destroy_weights_update_group to every server."""
        self.http.checked_all("destroy_weights_update_group", {"group_name": group_name})

    # ------------------------------------------------------------------ tensors (colocated)

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]],
                                   weight_version: str, *,
                                   serialize_fn: Callable[[list[tuple[str, Any]]], list[str]],
                                   load_format: str | None = None,
                                   flush_cache: bool | None = None) -> str:
        """Colocated GPU path (POST /update_weights_from_tensor inside a session).

        `serialize_fn` maps the tensors to `serialized_named_tensors`, one base64 string per
        server TP rank; with SGLang that is `MultiprocessingSerializer.serialize(...,
        output_str=True)` of CUDA IPC handles (GPU only: not provided here). One server only.
        """
        if len(self.http.base_urls) != 1:
            raise ValueError("update_weights_from_tensor is colocated: one server per trainer")
        version = str(weight_version)
        body = {"serialized_named_tensors": serialize_fn(named_tensors),
                "load_format": load_format, "flush_cache": self.flush(flush_cache),
                "abort_all_requests": False, "weight_version": version}
        with self.weight_update_session(version, "update_weights_from_tensor"):
            self.http.checked_all("update_weights_from_tensor", body)
        return version
