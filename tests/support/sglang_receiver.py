"""The receiving side of SGLang's update_weights_from_distributed, for the fake server.

Two implementations of one interface (`init_group`, `receive`, `destroy`):
  * `SGLangReceiver`: sglang's own `WeightUpdater` (srt/model_executor/model_runner_components/
    weight_updater.py) - used whenever the installed sglang API env is on the path (the fake
    server's `--receiver sglang`, the sglang_api tests, the e2e driver test when available);
  * `MirrorReceiver`: the same protocol restated with plain torch, for machines without the
    sglang env: group init as `init_custom_process_group` (utils/common.py:2859: TCP rendezvous,
    `PrefixStore(group_name)`, identity rank map, rank = rank_offset + tp_rank), default load
    format = one async broadcast per (name, dtype, shape) in order from rank 0, "flattened_bucket"
    = one uint8 broadcast of the tensors' bytes concatenated in order (weight_sync/
    tensor_bucket.py `FlattenedTensorBucket.empty`, which refuses unaligned offsets in 0.5.23).
    tests/rollout_bridge/sglang/test_sglang_client_box.py runs both receivers in one sync from the
    trainer's sender and requires bit-identical tensors.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from megatron_pdm.netutil import free_port


class MirrorReceiver:
    """Plain-torch restatement of SGLang's receiving protocol (module docstring)."""

    kind = "mirror"

    def __init__(self, tp_rank: int = 0, timeout_s: float = 600.0):
        self.tp_rank = tp_rank
        self.timeout = timedelta(seconds=timeout_s)
        self.groups: dict[str, object] = {}

    def init_group(self, master_address, master_port, rank_offset, world_size, group_name,
                   backend="nccl") -> tuple[bool, str]:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import (
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        try:
            rank = int(rank_offset) + self.tp_rank
            store, rank, world = next(rendezvous(f"tcp://{master_address}:{int(master_port)}",
                                                 rank, int(world_size), timeout=self.timeout))
            store.set_timeout(self.timeout)
            store = PrefixStore(group_name, store)
            # collective (group creation): returns once every rank has joined
            pg, _ = _new_process_group_helper(world, rank, [], dist.Backend(backend), store,
                                              group_name=group_name, backend_options=None,
                                              timeout=self.timeout)
            _world.pg_group_ranks[pg] = {i: i for i in range(world)}
            self.groups[group_name] = pg
            return True, "Succeeded to initialize custom process group."
        except Exception as exc:  # noqa: BLE001 - reported like SGLang does
            return False, f"Failed to initialize custom process group: {exc}."

    def receive(self, names, dtypes, shapes, group_name, load_format=None):
        import torch.distributed as dist

        pg = self.groups[group_name]
        if load_format == "flattened_bucket":
            metas, offset = [], 0
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                dt = getattr(torch, dtype)
                if offset % dt.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, "
                                     f"dtype {dt}")
                size = torch.Size(shape).numel() * dt.itemsize
                metas.append((name, dt, torch.Size(shape), offset, size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=pg)  # collective: the bucket's bytes from rank 0
            return [(name, flat[o:o + n].view(dt).reshape(shape))
                    for name, dt, shape, o, n in metas]
        out, works = [], []
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            works.append(dist.broadcast(t, src=0, group=pg, async_op=True))  # collective: one
            # tensor from rank 0, posted in `names` order like SGLang's receive
            out.append((name, t))
        for w in works:
            w.wait()
        return out

    def destroy(self, group_name) -> tuple[bool, str]:
        import torch.distributed as dist

        pg = self.groups.pop(group_name, None)
        if pg is None:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(pg)
        return True, "Succeeded to destroy custom process group."


class SGLangReceiver:
    """sglang's own model-runner `WeightUpdater` (needs the sglang API env on sys.path)."""

    kind = "sglang"

    def __init__(self, tp_rank: int = 0):
        import torch.distributed as dist
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            WeightUpdater,
        )

        if not dist.is_initialized():  # WeightUpdater asserts a default group exists
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    world_size=1, rank=0)
        self.wu = WeightUpdater(tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None,
                                custom_weight_loaders={}, get_model=lambda: None,
                                update_model_fields=lambda *a, **k: None,
                                recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)

    def init_group(self, master_address, master_port, rank_offset, world_size, group_name,
                   backend="nccl") -> tuple[bool, str]:
        return self.wu.init_weights_update_group(master_address, master_port, rank_offset,
                                                 world_size, group_name, backend=backend)

    def receive(self, names, dtypes, shapes, group_name, load_format=None):
        return self.wu.receive_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes,
                                                        group_name=group_name,
                                                        load_format=load_format)

    def destroy(self, group_name) -> tuple[bool, str]:
        return self.wu.destroy_weights_update_group(group_name)


def make_receiver(kind: str = "auto"):
    """"sglang", "mirror" or "auto" (sglang's when importable, else the mirror)."""
    if kind in ("sglang", "auto"):
        try:
            return SGLangReceiver()
        except ImportError:
            if kind == "sglang":
                raise
    return MirrorReceiver()
