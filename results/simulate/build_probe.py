"""Probe: build the Qwen3-30B-A3B GPTModel (driver build_model + cpu_shim) on fake tensors, world 8, TP4 EP8 ETP1, rank 0.

Run: OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python results/simulate/build_probe.py NUM_LAYERS
"""
import dataclasses, torch, torch.distributed as dist, time
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_pdm.arch import ModelArch
from megatron_pdm.mcore.cpu_shim import apply_cpu_shim; apply_cpu_shim()
from megatron_pdm.mcore.model import transformer_config, build_model
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
ps.initialize_model_parallel(tensor_model_parallel_size=4, expert_model_parallel_size=8, expert_tensor_parallel_size=1, create_gloo_process_groups=False)
arch = ModelArch.qwen3_30b_a3b()
arch = dataclasses.replace(arch, num_layers=int(__import__("sys").argv[1])) if hasattr(arch, "num_layers") else arch
import sys; NL=int(sys.argv[1]); t=time.time()
with FakeTensorMode(allow_non_fake_inputs=True):
    cfg = transformer_config(arch, tp=4, ep=8, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True, num_layers=NL, perform_initialization=False)
    m = build_model(arch, cfg)
    n = sum(p.numel() for p in m.parameters())
    print("built", NL, "layers, local params", n, "vocab", m.embedding.word_embeddings.weight.shape, "s", round(time.time()-t,1))
