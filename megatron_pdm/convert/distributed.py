"""Process-group plumbing for the converters: run a function on every rank of a layout.

Two ways in:
- under `torchrun` (WORLD_SIZE/RANK/MASTER_ADDR in the environment): the function runs once in
  this process with the env:// rendezvous; use this for large layouts spread over many hosts;
- otherwise `launch` spawns `world_size` local processes itself (gloo on 127.0.0.1, one thread
  each), so `--tp 2 --ep 2` works from a plain single-process command on a laptop or in CI. The
  rendezvous store is bound by this process on port 0 (the OS's choice) and held while the
  workers connect as clients: no free port is picked first and bound later (the race that
  netutil.free_port has). A one-rank layout runs in this process on an in-memory store.

Conversion moves weights only (no forward pass), so it always uses gloo, also on GPU hosts.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from datetime import timedelta

HOST = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=600)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    """A spawned rank: joins the caller's store (a client of it) and runs fn."""
    store = dist.TCPStore(HOST, port, is_master=False, timeout=STORE_TIMEOUT)
    _run_rank(store, rank, world_size, fn, args)


def _run_rank(store, rank: int, world_size: int, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args) -> None:
    """Run `fn(*args)` on every rank of a gloo world of `world_size` processes.

    Under torchrun the current process is one rank (the torchrun world size must match).
    `fn` must be a module-level function (it is pickled into spawned processes).
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"this layout needs world size {world_size}, the process group has "
                f"{dist.get_world_size()}"
            )
        fn(*args)
        return
    if under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(f"torchrun started {env_world} ranks, this layout needs {world_size}")
        dist.init_process_group("gloo")
        try:
            fn(*args)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        return
    if world_size == 1:
        _run_rank(dist.HashStore(), 0, 1, fn, args)
        return
    import torch.multiprocessing as mp

    # the store's server: bound on an OS-assigned port now, alive until every rank has joined
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    try:
        mp.spawn(_entry, args=(world_size, store.port, fn, args), nprocs=world_size, join=True)
    finally:
        del store


def init_model_parallel(tp: int, ep: int, pp: int) -> None:
    """megatron parallel_state for the layout (shared with the trainer)."""
    from megatron_pdm.mcore.parallel import init_model_parallel as _init

    _init(tp, ep, pp)


def launch_rank() -> int:
    """This process's rank in the world `launch` runs on: the formed group's rank, torchrun's
    RANK, or 0 for a caller whose ranks `launch` spawns (the caller is not one of them)."""
    if dist.is_initialized():
        return dist.get_rank()
    if under_torchrun():
        return int(os.environ["RANK"])
    return 0


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
