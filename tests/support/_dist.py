"""run_gloo: run a function on `world_size` spawned CPU processes joined in a gloo group.

Each worker gets (rank, world_size, *args), a default process group over 127.0.0.1, one
intra-op thread (2-core CI boxes), and the group is destroyed in `finally` (after a barrier
when fn returned). The rendezvous store
is created by the calling process on a port the OS assigns while binding it (port 0) and held
until the workers are joined; the workers connect to it as clients. No port is chosen first and
bound later, so another process cannot take it in between (with a free port handed to rank 0,
that race failed a CI run with EADDRINUSE while other jobs shared the machine). A worker
exception fails the calling test (torch.multiprocessing re-raises it with the traceback).
Each worker imports megatron_pdm before calling fn: a spawned interpreter starts bare, and the
package's import installs the triton stand-in that megatron-core 0.19 needs on CPU torch before
any `import megatron.core` (megatron_pdm/triton_stub.py); without it a worker that imports
megatron.core first fails there. The function must be importable at module level (spawn
pickles it by reference).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from datetime import timedelta

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=300)


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    import megatron_pdm  # noqa: F401  (the triton stand-in, before fn imports megatron.core)

    os.environ["MASTER_ADDR"] = HOST  # for code that reads them (the group needs neither)
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # every rank done with every collective before any rank tears its group down: a rank
        # that destroyed its gloo group (and exited) while a peer still finished the last
        # exchange aborted once in a fresh-clone run ("terminate called without an active
        # exception", SIGABRT, tests/base/test_own_loop.py). Not after an exception: the failed
        # rank's exit ends the others (torch.multiprocessing terminates them), and a barrier
        # broken by a peer that failed is not this rank's error: the peer's own error is the
        # one the test must see (raising here could be reported first).
        try:
            dist.barrier()
        except RuntimeError:
            pass
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args) -> None:
    """Runs fn(rank, world_size, *args) on world_size gloo processes; raises on any failure."""
    # the store's server: bound on an OS-assigned port now, alive until every worker has joined
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    try:
        mp.start_processes(
            _worker, args=(world_size, store.port, fn, args), nprocs=world_size, join=True,
            start_method="spawn",
        )
    finally:
        del store
