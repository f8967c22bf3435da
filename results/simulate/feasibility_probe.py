"""Probe: which torch/megatron-core pieces a fake-tensor simulation of the cluster recipe can use.

Run: OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python results/simulate/feasibility_probe.py
Prints one line per probe; writes nothing.
"""
import platform

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore


def attempt(name, fn):
    try:
        out = fn()
        print(f"{name}: ok {out if out is not None else ''}")
    except Exception as e:  # the probe reports every failure as a line
        print(f"{name}: FAIL {type(e).__name__}: {str(e)[:110]}")


print("torch", torch.__version__, "cuda available", torch.cuda.is_available(), platform.processor())
with FakeTensorMode():
    head_vd = torch.empty(151936, 2048, device="cuda", dtype=torch.bfloat16)
    attempt("fake cuda empty [151936,2048] bf16", lambda: head_vd.device)
    attempt("fake cuda mul", lambda: (head_vd * 2).device)
    attempt("fake cuda matmul", lambda: head_vd.t().matmul(head_vd).shape)
    attempt("fake cuda view", lambda: head_vd.view(2048, 151936).shape)
    attempt("fake cuda slice a[:2]", lambda: head_vd[:2].shape)
    attempt("fake cuda narrow", lambda: head_vd.narrow(0, 0, 2).shape)
    attempt("fake cuda + cpu tensor (device bug)", lambda: (head_vd + torch.ones(2048)).device)
    meta_vd = torch.empty(8, 16, device="meta")
    attempt("meta + cpu tensor (device bug)", lambda: (meta_vd + torch.ones(16)).device)

dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=32)
group = dist.new_group(list(range(0, 32, 8)))
buf = torch.zeros(4)
attempt("fake pg all_reduce world", lambda: dist.all_reduce(buf))
attempt("fake pg group size seen by a non-member", lambda: dist.get_world_size(group))
attempt("MemTracker import", lambda: __import__("torch.distributed._tools.mem_tracker", fromlist=["MemTracker"]).MemTracker.__name__)
from megatron.core import parallel_state as ps
attempt("mcore initialize_model_parallel TP4 EP8 (gloo groups on)",
        lambda: ps.initialize_model_parallel(tensor_model_parallel_size=4, expert_model_parallel_size=8))
ps.destroy_model_parallel()
attempt("mcore initialize_model_parallel TP4 EP8 create_gloo_process_groups=False",
        lambda: ps.initialize_model_parallel(tensor_model_parallel_size=4, expert_model_parallel_size=8,
                                             create_gloo_process_groups=False))
attempt("mcore ranks (tp, ep, dp)", lambda: (ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(),
                                              ps.get_data_parallel_world_size()))
