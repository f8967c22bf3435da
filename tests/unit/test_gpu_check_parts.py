"""benchmarks/gpu_check.py pieces that run on CPU: the TP check on gloo, the synthetic rollout.

The full script needs a GPU: tests/gpu/test_gpu_check.py."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _tp_rank(rank, port, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = _load().tp_check(vocab=1000, tokens=32, device="cpu")
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp_check_part_passes_on_gloo(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "tp.json"
    mp.spawn(_tp_rank, args=(port, str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["max_abs_diff"]["logprob"] < 1e-4
    assert result["worst"] < 1e-3, result


def test_synthetic_rollout_is_a_valid_support():
    gc = _load()
    logits = torch.randn(16, 1024)
    batch = gc.synthetic_rollout(logits, top_k=4, vocab_size=1000)
    assert (batch["support_ids"] < 1000).all()
    assert torch.equal(batch["support_ids"][:, 0], batch["sampled_ids"])
    # the sampled token is folded in once: a top-K duplicate of it is marked invalid
    dup = batch["support_ids"][:, 1:] == batch["sampled_ids"][:, None]
    assert torch.equal(batch["support_valid"][:, 1:], ~dup)
