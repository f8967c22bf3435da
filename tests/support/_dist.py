"""run_gloo: run a function on `world_size` CPU processes joined in a gloo group.

Each worker runs fn(rank, world_size, *args) in a default process group over 127.0.0.1 with one
intra-op thread (2-core CI boxes); a barrier follows when fn returned, so every rank is done with
every collective before the next call (or the group's teardown). A worker exception fails the
calling test with the worker's traceback. The function must be importable at module level (it is
pickled by reference).

The workers of world sizes 1 and 2 are a pool kept for the test session (`run_gloo` starts it
on first use, `atexit` stops it). A spawned interpreter spends ~5 s importing torch and
megatron-core before fn runs; with a pool it pays that once per session, not once per test.
Between calls a worker restores what a test may leave behind: the environment, torch's thread
count and default dtype, megatron's model-parallel state (destroyed if fn left it initialised).
After any failure (an exception, a worker that died, a call past CALL_TIMEOUT_S) the pool is
killed and the next call starts a new one: a group in which one rank failed can no longer be
trusted. A pool whose worker holds more than MAX_THREADS threads after its reset is closed after
its call and replaced the same way. Other world sizes, `fresh=True` and PDM_GLOO_POOL=0 in the
environment start new processes for the one call.

Rendezvous: the rendezvous store is created by the calling process on a port the OS assigns
while binding it (port 0) and held while the workers live; the workers connect to it as clients.
No port is chosen first and bound later, so another process cannot take it in between (with a
free port handed to rank 0, that race failed a CI run with EADDRINUSE while other jobs shared the
machine). Each worker imports megatron_pdm before calling fn: a spawned interpreter starts bare,
and the package's import installs the triton stand-in that megatron-core 0.19 needs on CPU torch
before any `import megatron.core` (megatron_pdm/triton_stub.py); without it a worker that imports
megatron.core first fails there.
"""

from __future__ import annotations

import atexit
import collections
import gc
import os
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=300)
POOLED_WORLD_SIZES = (1, 2)
CALL_TIMEOUT_S = 1800.0
"""A call that has not returned by then is a hang: the pool is killed and the test fails."""
ERROR_GRACE_S = 2.0
"""After one rank's error, how long the others get to report theirs (all go in the message)."""
MAX_THREADS = 256
"""A pooled worker past this many threads after its reset asks to retire, and the next call starts
a new pool: a bound on whatever a call leaves running that the reset cannot stop (the reset frees
the process groups' threads, `_destroy_subgroups`)."""


def _join_group(rank: int, world_size: int, port: int) -> None:
    import megatron_pdm  # noqa: F401  (the triton stand-in, before fn imports megatron.core)

    os.environ["MASTER_ADDR"] = HOST  # for code that reads them (the group needs neither)
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _barrier_after_success() -> None:
    # every rank done with every collective before any rank goes on: a rank that destroyed its
    # gloo group (and exited) while a peer still finished the last exchange aborted once in a
    # fresh-clone run ("terminate called without an active exception", SIGABRT,
    # tests/base/test_own_loop.py). Not after an exception: the failed rank's error is the one
    # the test must see, and a barrier broken by it is not this rank's error.
    try:
        dist.barrier()  # collective: every rank of the default group
    except RuntimeError:
        pass


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    """One call in new processes (torch.multiprocessing joins them and re-raises an error)."""
    _join_group(rank, world_size, port)
    try:
        fn(rank, world_size, *args)
        _barrier_after_success()
    finally:
        dist.destroy_process_group()


def _reset(env: dict) -> None:
    """What one call may leave in a pooled worker, put back before the next."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _break_ddp_hook_cycles()
    _destroy_subgroups()
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)


_DDP_HOOK = "DistributedDataParallel._make_backward_post_hook"


def _break_ddp_hook_cycles() -> None:
    """megatron's DistributedDataParallel registers a hook on each parameter's grad accumulator (a
    C++ autograd node) whose closure holds the DDP module: a cycle through C++ that Python's
    collector cannot see, so every model a call built outlived it, with its memory and its process
    groups. Empties those hooks' dicts and the DDP's `grad_accs` (one pass over the collector's
    objects: ~0.05 s)."""
    for obj in gc.get_objects():
        if type(obj) is collections.OrderedDict:
            if obj and all(getattr(v, "__qualname__", "").startswith(_DDP_HOOK)
                           for v in obj.values()):
                obj.clear()
        elif type(obj).__name__ == "DistributedDataParallel" and \
                isinstance(getattr(obj, "grad_accs", None), list):
            obj.grad_accs.clear()


def _destroy_subgroups() -> None:
    """Destroys every process group but the default one, then collects the garbage that still
    holds them: megatron's destroy_model_parallel only forgets its groups, and each gloo group
    keeps its threads (two work threads and a transport loop, which wakes up on its own) until
    the group object is freed. Without this and `_break_ddp_hook_cycles` a worker gained ~50
    threads per megatron test and, at ~470, spent ~13% of a core while idle, the 1-minute load at
    15-30 (measured). Local: no collective (every rank has passed the barrier after the call, and
    every rank resets)."""
    from torch.distributed.distributed_c10d import _world

    default = dist.group.WORLD
    for group in list(_world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
    gc.collect()


def _pool_worker(rank: int, world_size: int, port: int, conn) -> None:
    """A pooled worker: joins the group once, then runs the calls the pipe brings until None."""
    _join_group(rank, world_size, port)
    env = dict(os.environ)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the session's process is gone
            return
        if job is None:
            break
        try:
            fn, args = job
            value = fn(rank, world_size, *args)
            _barrier_after_success()
            _reset(env)  # inside the try: a failed reset reaches the test with its traceback
        except BaseException:  # noqa: BLE001 (reported to the caller, which kills the pool)
            conn.send(("error", traceback.format_exc()))
            return
        retire = _thread_count() > MAX_THREADS
        try:
            conn.send(("ok", value, retire))
        except Exception:  # noqa: BLE001 (a return value that does not pickle is not needed)
            conn.send(("ok", None, retire))
    dist.destroy_process_group()


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: never retire on this count
        return 0


class _Pool:
    """`world_size` spawned workers in one gloo group, and the store they met at."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.retire = False  # set when a worker asked to retire (MAX_THREADS); see _run_pooled
        # the store's server: bound on an OS-assigned port now, alive as long as the pool
        self.store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                                   timeout=TIMEOUT)
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            # not a daemon: a call may start processes of its own (megatron's checkpoint writer)
            proc = ctx.Process(target=_pool_worker, name=f"gloo-pool-w{world_size}-r{rank}",
                               args=(rank, world_size, self.store.port, theirs))
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def run(self, fn, args: tuple) -> list:
        """fn on every rank; returns their return values by rank; raises (after killing the
        pool) on any rank's failure."""
        try:
            for conn in self.conns:
                conn.send((fn, args))
        except Exception:
            self.close(kill=True)
            raise
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        values: list = [None] * self.world_size
        deadline = time.monotonic() + CALL_TIMEOUT_S
        graced = False
        while pending:
            if errors and not graced:  # the others' errors, if any, within a short grace period
                deadline, graced = min(deadline, time.monotonic() + ERROR_GRACE_S), True
            left = deadline - time.monotonic()
            waits = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            if left <= 0 or not wait(waits, timeout=left):
                break
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn.poll():
                    try:
                        status, detail, *rest = conn.recv()
                    except EOFError:
                        status, detail, rest = "error", f"exited with code {proc.exitcode}", []
                    self.retire = self.retire or bool(rest and rest[0])
                elif not proc.is_alive():
                    status, detail = "error", f"exited with code {proc.exitcode} without a result"
                else:
                    continue
                pending.discard(rank)
                if status == "ok":
                    values[rank] = detail
                else:
                    errors[rank] = detail
        if errors or pending:
            self.close(kill=True)
            # in the order they arrived: the first is usually the cause, later ones its echo
            parts = [f"rank {r} of {self.world_size} failed:\n{tb}" for r, tb in errors.items()]
            if pending and not errors:
                parts.append(f"ranks {sorted(pending)} of {self.world_size} gave no result "
                             f"within {CALL_TIMEOUT_S:.0f} s")
            raise RuntimeError("run_gloo(" + getattr(fn, "__qualname__", repr(fn)) + "): "
                               + "\n".join(parts))
        return values

    def close(self, *, kill: bool = False) -> None:
        """Asks every worker to stop (one in a collective with a failed peer gets there once
        that collective fails) and waits 10 s, or 2 s after a failure (`kill`); then kills what
        is left, with its children (megatron's checkpoint writer starts a manager process that
        would outlive a killed worker)."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:  # that worker has already gone
                pass
        deadline = time.monotonic() + (2.0 if kill else 10.0)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                _kill_tree(proc)
            proc.join()
        for conn in self.conns:
            conn.close()
        del self.store


def _kill_tree(proc) -> None:
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 (no psutil, or the process is gone: kill what we can)
        children = []
    for child in children:
        try:
            child.kill()
        except Exception:  # noqa: BLE001
            pass
    proc.kill()


_POOLS: dict[int, _Pool] = {}


def _pooled(world_size: int) -> bool:
    return world_size in POOLED_WORLD_SIZES and os.environ.get("PDM_GLOO_POOL", "1") != "0"


def _run_pooled(fn, world_size: int, args: tuple) -> list:
    """fn on the pool of `world_size` (started if there is none); a failed pool is dropped."""
    if world_size not in _POOLS:
        _POOLS[world_size] = _Pool(world_size)
    pool = _POOLS[world_size]
    try:
        return pool.run(fn, args)
    finally:
        if _POOLS.get(world_size) is pool:
            if pool.retire:  # a worker past MAX_THREADS: the whole group stops together
                del _POOLS[world_size]
                pool.close()
            elif not all(p.is_alive() for p in pool.procs):
                del _POOLS[world_size]


@atexit.register
def close_pools() -> None:
    """Stops the pooled workers (atexit: before multiprocessing joins its children)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_gloo(fn, world_size: int, *args, fresh: bool = False) -> None:
    """Runs fn(rank, world_size, *args) on world_size gloo processes; raises on any failure.
    `fresh=True` runs it in new processes even where a pool would be used."""
    if not fresh and _pooled(world_size):
        _run_pooled(fn, world_size, args)
        return
    # the store's server: bound on an OS-assigned port now, alive until every worker has joined
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    try:
        mp.start_processes(
            _worker, args=(world_size, store.port, fn, args), nprocs=world_size, join=True,
            start_method="spawn",
        )
    finally:
        del store


def _tool_on_rank(rank: int, world_size: int, tool, args: tuple, kwargs: dict):
    return tool(*args, **kwargs)


def run_tool(tool, world_size: int, *args, **kwargs):
    """`tool(*args, **kwargs)` (a converter or verifier function of megatron_pdm.tools whose ranks
    are started by convert/distributed.py `launch`) on the pooled workers of `world_size`, one
    call per rank: `launch` finds the group formed and runs its rank function in place, the
    path it takes under torchrun. Returns rank 0's return value. Where no pool is used (other
    world sizes, PDM_GLOO_POOL=0) the tool is called here and spawns its own ranks; the tests
    of that path call the tools directly (tests/convert/test_round_trip.py, test_real_model.py).
    """
    if not _pooled(world_size):
        return tool(*args, **kwargs)
    return _run_pooled(_tool_on_rank, world_size, (tool, args, kwargs))[0]
