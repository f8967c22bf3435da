"""run_gloo: run a function on `world_size` spawned CPU processes joined in a gloo group.

Each worker gets (rank, world_size, *args), a default process group over 127.0.0.1 on a free
port, one intra-op thread (2-core CI boxes), and the group is destroyed in `finally`. A worker
exception fails the calling test (torch.multiprocessing re-raises it with the traceback).
The function must be importable at module level (spawn pickles it by reference).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_pdm.netutil import free_port


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args) -> None:
    """Runs fn(rank, world_size, *args) on world_size gloo processes; raises on any failure."""
    mp.start_processes(
        _worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True,
        start_method="spawn",
    )
