"""Trainer side of SGLang's broadcast weight sync (`update_weights_from_distributed`; torch only,
no sglang import).

* `join_weight_update_group` joins the group the servers create in /init_weights_update_group
  exactly like SGLang's `init_custom_process_group` (utils/common.py:2859-2927 (0.5.23)): TCP
  rendezvous at master_address:master_port, the store wrapped in `PrefixStore(group_name)`, an
  identity rank map. The trainer is rank 0; server i's TP rank r is rank
  `rank_offset_i + r` with `rank_offset_i = 1 + sum of the TP sizes of servers 0..i-1`
  (model_runner_components/weight_updater.py:124). A plain `init_process_group` on that address
  would use another store prefix and never meet the servers.
* `DistributedWeightSender.push(named_tensors, version)` packs the tensors into buckets of one
  dtype (at most `bucket_bytes`), and per bucket posts /update_weights_from_distributed (names,
  dtypes, shapes in order) to every server while broadcasting from rank 0: one uint8 broadcast
  of the bucket's bytes (`load_format="flattened_bucket"`, `FlattenedTensorBucket` on the
  server; one dtype per bucket keeps every tensor aligned, which 0.5.23 checks) or one broadcast
  per tensor (`load_format=None`). The next bucket is gathered while the current one is on the
  wire (at most two buckets alive). Only the last bucket carries `weight_version` and
  `flush_cache` (one version change and one flush per sync). The HTTP side is
  rollout_bridge/sglang/weights.py (`SGLangWeightSync`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from rollout_bridge.core.types import EngineMismatchError, WeightSyncError
from rollout_bridge.sglang.http import SGLangServerError
from rollout_bridge.sglang.weights import LOAD_FORMATS, SGLangWeightSync

logger = logging.getLogger(__name__)

_GROUP_IDS = itertools.count(1)


def join_weight_update_group(master_address: str, master_port: int, world_size: int,
                             group_name: str, backend: str, timeout_s: float = 600.0):
    """Joins the servers' weight-update group as rank 0, the way SGLang's
    `init_custom_process_group` creates it (module docstring). Returns the process group.

    Blocks until every server rank has joined (their /init_weights_update_group requests must be
    in flight). Works next to the trainer's default group: nothing of it is touched.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    # Rank 0 must host the TCP store the servers connect to. Under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True) `rendezvous` would make every rank a client of the
    # agent's store and nobody would host this group's: the variable is lifted for the call.
    agent = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        store, rank, world = next(rendezvous(f"tcp://{master_address}:{int(master_port)}", 0,
                                             int(world_size), timeout=timeout))
    finally:
        if agent is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # Collective (group creation): returns once every server rank has joined.
    pg, _ = _new_process_group_helper(world, rank, [], dist.Backend(backend), store,
                                      group_name=group_name, backend_options=None,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


@dataclasses.dataclass
class Bucket:
    """Tensors of one dtype sent in one /update_weights_from_distributed request."""

    names: list[str]
    tensors: list[torch.Tensor]
    dtype: torch.dtype
    nbytes: int = 0

    def flat(self) -> torch.Tensor:
        """The tensors' bytes concatenated in order (what `FlattenedTensorBucket` receives)."""
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in self.tensors])


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[Bucket]:
    """Groups (name, tensor) in order into buckets of one dtype and at most `bucket_bytes`
    (a larger tensor gets a bucket of its own)."""
    cur: Bucket | None = None
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if cur is not None and (t.dtype != cur.dtype or cur.nbytes + nbytes > bucket_bytes):
            yield cur
            cur = None
        if cur is None:
            cur = Bucket([], [], t.dtype)
        cur.names.append(name)
        cur.tensors.append(t)
        cur.nbytes += nbytes
    if cur is not None:
        yield cur


class DistributedWeightSender:
    """Streams named tensors to every SGLang server over one broadcast group (module docstring).

    Args:
        client: The servers: an `SGLangEngine` (its weight-sync part is used) or its
            `SGLangWeightSync`.
        master_address: Address of this (trainer rank 0) host that every server can reach.
        master_port: Free TCP port on it for the group's rendezvous.
        backend: "nccl" (GPU clusters) or "gloo" (CPU; the CI path).
        group_name: Name of the group on the servers (and the store prefix).
        bucket_bytes: Bucket size (one request and, flattened, one broadcast per bucket).
        load_format: "flattened_bucket" (one broadcast per bucket) or None (one per tensor).
        server_tp_sizes: TP size per server; default: read from each server's /server_info.
        timeout_s: Timeout of the group's collectives.
    """

    def __init__(self, client, *, master_address: str, master_port: int,
                 backend: str = "nccl", group_name: str = "pdm_weight_sync",
                 bucket_bytes: int = 512 << 20, load_format: str | None = "flattened_bucket",
                 server_tp_sizes: list[int] | None = None, timeout_s: float = 600.0):
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}")
        self.client = client
        self.sync: SGLangWeightSync = getattr(client, "weights", client)
        self.master_address, self.master_port = master_address, int(master_port)
        self.backend, self.base_group_name = backend, group_name
        self.group_name = group_name
        self._generation = 0
        self.bucket_bytes, self.load_format = int(bucket_bytes), load_format
        self.server_tp_sizes = server_tp_sizes
        self.timeout_s = float(timeout_s)
        self.pg = None
        self.world_size = 0
        self.stats: dict[str, float] = {}

    def connect(self) -> None:
        """Creates the group: one request per server (own rank offset), the trainer as rank 0."""
        if self.pg is not None:
            return
        tps = self.server_tp_sizes
        if tps is None:
            try:
                layout = self.sync.control.server_layout()
            except SGLangServerError as exc:
                raise WeightSyncError(f"cannot read the servers' layout: {exc}") from exc
            for url, lay in zip(self.sync.http.base_urls, layout):
                if lay["dp_size"] != 1 or lay["pp_size"] != 1:
                    raise EngineMismatchError(
                        f"{url}: dp_size={lay['dp_size']}, pp_size={lay['pp_size']}: SGLang's "
                        "weight-update group needs dp_size 1 and pp_size 1 (one rank per TP rank)")
            tps = [lay["tp_size"] for lay in layout]
        if len(tps) != len(self.sync.http.base_urls):
            raise ValueError(f"{len(tps)} TP sizes for {len(self.sync.http.base_urls)} servers")
        offsets, nxt = [], 1
        for tp in tps:
            offsets.append(nxt)
            nxt += int(tp)
        self.world_size = nxt
        try:  # fail fast (e.g. 401) before the rendezvous, which could only time out
            self.sync.control.weight_versions()
        except Exception as exc:
            raise WeightSyncError(f"cannot reach the SGLang servers: {exc}") from exc
        # a fresh name per group, unique in this process (torch refuses a second group of one
        # name) and for the servers (after a failed push they may still hold the old one)
        self._generation = next(_GROUP_IDS)
        self.group_name = f"{self.base_group_name}_{os.getpid()}_{self._generation}"
        t0 = time.perf_counter()
        self.pg = self.sync.init_weights_update_group(
            self.master_address, self.master_port, self.group_name, rank_offsets=offsets,
            world_size=self.world_size, backend=self.backend,
            join=lambda: join_weight_update_group(self.master_address, self.master_port,
                                                  self.world_size, self.group_name,
                                                  self.backend, self.timeout_s))
        logger.info("weight-update group %s: trainer rank 0 + %d server rank(s) on %d server(s) "
                    "(%s, %.1f s)", self.group_name, self.world_size - 1, len(tps), self.backend,
                    time.perf_counter() - t0)

    def close(self) -> None:
        """Destroys the group on the servers and here."""
        if self.pg is None:
            return
        import torch.distributed as dist

        try:
            self.sync.destroy_weights_update_group(self.group_name)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.pg)
            self.pg = None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> dict:
        """Sends every (name, tensor) to every server as `version` (one session).

        The iterator is consumed while earlier buckets are on the wire, so a collective
        iterator (the live megatron gather) overlaps with the transfer.

        Returns:
            {"buckets", "tensors", "bytes", "seconds"}.
        """
        self.connect()
        version = str(version)
        t0 = time.perf_counter()
        self.stats = {"buckets": 0, "tensors": 0, "bytes": 0}
        with self.sync.weight_update_session(version, "update_weights_from_distributed"), \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            inflight = None
            pending: Bucket | None = None
            for bucket in buckets(named_tensors, self.bucket_bytes):
                if pending is not None:
                    inflight = self._send(pool, pending, inflight, last=False, version=version)
                pending = bucket
            if pending is None:
                raise WeightSyncError("nothing to send: the weight iterator was empty")
            inflight = self._send(pool, pending, inflight, last=True, version=version)
            self._wait(inflight)
        n = dict(self.stats, seconds=time.perf_counter() - t0)
        logger.info("weights pushed as version %s: %d bucket(s), %d tensors, %.1f MB, %.2f s",
                    version, n["buckets"], n["tensors"], n["bytes"] / 1e6, n["seconds"])
        return n

    def _send(self, pool, bucket: Bucket, inflight, *, last: bool, version: str):
        import torch.distributed as dist

        body = self.sync.distributed_update_body(
            bucket.names, [bucket.dtype] * len(bucket.names),
            [list(t.shape) for t in bucket.tensors], self.group_name,
            load_format=self.load_format, weight_version=version if last else None,
            flush_cache=self.sync.flush(None) if last else False)
        # flattened while the previous bucket is still on the wire: [bytes] uint8
        payloads = [bucket.flat()] if self.load_format == "flattened_bucket" else \
            [t.contiguous() for t in bucket.tensors]
        self._wait(inflight)  # the servers take one bucket at a time
        fut = pool.submit(self.sync.post_distributed_update, body)
        # Collective (weight-update group, async): rank 0 -> every server rank, received by
        # SGLang's `receive_weights_from_distributed` for the body just posted: one uint8
        # broadcast of the bucket's bytes (flattened_bucket) or one per tensor in `names` order.
        works = [dist.broadcast(p, src=0, group=self.pg, async_op=True) for p in payloads]
        self.stats["buckets"] += 1
        self.stats["tensors"] += len(bucket.names)
        self.stats["bytes"] += bucket.nbytes
        return fut, works, payloads

    def _wait(self, inflight) -> None:
        if inflight is None:
            return
        fut, works, _ = inflight
        try:
            fut.result()
        except Exception as exc:
            # The servers will not receive this bucket: the broadcast can never complete.
            self._abandon()
            raise WeightSyncError(f"update_weights_from_distributed failed: {exc}") from exc
        for w in works:
            w.wait()

    def _abandon(self) -> None:
        """Drops the group after a failed bucket (its pending broadcast cannot complete); the
        next push creates a new one under a new name."""
        import torch.distributed as dist

        pg, self.pg = self.pg, None
        if pg is None:
            return
        with contextlib.suppress(Exception):
            self.sync.destroy_weights_update_group(self.group_name)
        with contextlib.suppress(Exception):
            pg.abort()
        with contextlib.suppress(Exception):
            dist.destroy_process_group(pg)
