"""Weight sync without disk: our SGLang push vs a bare broadcast vs the disk path (CPU, gloo).

What is timed, per tensor set, on this machine (every process on 127.0.0.1, gloo):

* push: `DistributedWeightSender.push` (rollout_bridge/sglang/broadcast.py), the driver's path,
  into `--servers` fake SGLang server processes (tests/support/fake_sglang.py, receivers following
  SGLang's protocol, `--discard-weights`: received, not loaded): pause -> begin -> per bucket an
  HTTP /update_weights_from_distributed to every server + the broadcast -> end -> continue ->
  /model_info version check, in both load formats: "flattened" (one uint8 broadcast per bucket,
  flattened by the sender, received into a fresh buffer) and "per tensor" (one broadcast per
  tensor). The group is created by a warm-up push that is not timed.
* bare: the same bytes, in the same bucket sizes, broadcast with `torch.distributed.broadcast`
  from rank 0 to the same number of plain receiver processes (no HTTP), ended by a barrier;
  receive buffers either reused across reps (pure transport) or fresh per bucket (what SGLang's
  flattened receive does: on CPU a fresh 512 MB buffer costs its page faults).
* disk: the same tensors written with safetensors (one file per bucket, fsync) and read back
  (`safetensors.torch.load_file`) after evicting the files from the page cache
  (posix_fadvise DONTNEED on each file): the write + read of the disk fallback, without its
  megatron dist-checkpoint step.

Tensor sets: the tiny CPU model's HF state dict (examples/tiny_cpu/config.yaml, fp32), and
`--layers` decoder layers of Qwen3-30B-A3B as synthetic bf16 tensors of the real shapes (hidden
2048, 32 q / 4 kv heads of 128, 128 experts of width 768, vocab 151936) with the real default
bucket size (rollout.sglang.weight_sync.bucket_mb = 512). The per-byte time of the 30B layers is
extrapolated to the whole model (48 layers + embeddings + head, computed from the same shapes),
and the per-iteration sync is projected at `--nccl-gbps` (an assumed NCCL broadcast bandwidth,
stated in the output) times the measured push/bare ratio.

Not a timed test: a measurement (median of `--reps`). Output: a markdown table on stdout and
JSON (--out).

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_weight_sync.py [--layers 1]
         [--reps 3] [--servers 1] [--nccl-gbps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "bridge")]

import torch

from megatron_pdm.netutil import free_port

BUCKET_MB = 512
QWEN3_30B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, moe_inter=768,
                 vocab=151936, layers=48)


def qwen3_layer_shapes(i: int, c: dict = QWEN3_30B) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of decoder layer i of Qwen3-30B-A3B (per-expert layout)."""
    h, d, p = c["hidden"], c["head_dim"], f"model.layers.{i}."
    out = [(p + "input_layernorm.weight", (h,)),
           (p + "self_attn.q_proj.weight", (c["heads"] * d, h)),
           (p + "self_attn.k_proj.weight", (c["kv_heads"] * d, h)),
           (p + "self_attn.v_proj.weight", (c["kv_heads"] * d, h)),
           (p + "self_attn.o_proj.weight", (h, c["heads"] * d)),
           (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
           (p + "post_attention_layernorm.weight", (h,)),
           (p + "mlp.gate.weight", (c["experts"], h))]
    for e in range(c["experts"]):
        q = f"{p}mlp.experts.{e}."
        out += [(q + "gate_proj.weight", (c["moe_inter"], h)),
                (q + "up_proj.weight", (c["moe_inter"], h)),
                (q + "down_proj.weight", (h, c["moe_inter"]))]
    return out


def qwen3_model_bytes(c: dict = QWEN3_30B, itemsize: int = 2) -> int:
    """Bytes of the whole model in bf16: every layer + embeddings + head + final norm."""
    per_layer = sum(torch.Size(s).numel() for _, s in qwen3_layer_shapes(0, c))
    other = 2 * c["vocab"] * c["hidden"] + c["hidden"]
    return (c["layers"] * per_layer + other) * itemsize


def qwen3_layers(n: int) -> list[tuple[str, torch.Tensor]]:
    """n decoder layers as bf16 tensors (constant values: the content does not change timing)."""
    return [(name, torch.full(shape, 0.01, dtype=torch.bfloat16))
            for i in range(n) for name, shape in qwen3_layer_shapes(i)]


def tiny_model() -> list[tuple[str, torch.Tensor]]:
    """The tiny CPU run's HF state dict (names and shapes of its architecture, fp32)."""
    from megatron_pdm.convert import mapping
    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.rollout.vllm_server.model_dir import run_arch

    arch = run_arch(RunConfig.load(str(ROOT / "examples" / "tiny_cpu" / "config.yaml"), []))
    gen = torch.Generator().manual_seed(0)
    return [(n, torch.randn(s, generator=gen)) for n, s in
            mapping.hf_shapes(arch, "per_expert").items()]


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


# ------------------------------------------------------------------------------ bare broadcast


def _bare_receiver(rank: int, world: int, port: int, sizes: list[int], reps: int,
                   fresh: bool) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from sglang_receiver import MirrorReceiver

    recv = MirrorReceiver(tp_rank=0, timeout_s=600)
    ok, msg = recv.init_group("127.0.0.1", port, rank, world, "bare", backend="gloo")
    assert ok, msg
    pg = recv.groups["bare"]
    kept = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(reps):
        # fresh: a new buffer per bucket, as SGLang's flattened receive allocates; else reused
        bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes] if fresh else kept
        for b in bufs:
            dist.broadcast(b, src=0, group=pg)  # collective: the bucket's bytes from rank 0
        dist.barrier(group=pg)  # collective: the trainer's clock stops when all have received


def bare_broadcast(sizes: list[int], receivers: int, reps: int, fresh: bool) -> list[float]:
    """Seconds per rep of broadcasting buffers of `sizes` bytes from here (rank 0)."""
    import torch.distributed as dist

    from rollout_bridge.sglang.broadcast import join_weight_update_group

    port, world = free_port(), receivers + 1
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_bare_receiver, args=(r + 1, world, port, sizes, reps, fresh))
             for r in range(receivers)]
    for p in procs:
        p.start()
    pg = join_weight_update_group("127.0.0.1", port, world, "bare", "gloo", 600)
    bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for b in bufs:
            dist.broadcast(b, src=0, group=pg)  # collective: bucket bytes to every receiver
        dist.barrier(group=pg)  # collective: every receiver has the bytes
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join(120)
    dist.destroy_process_group(pg)
    return times


# ------------------------------------------------------------------------------ our push


def push_times(named, servers, reps: int, load_format: str | None = "flattened_bucket"
               ) -> tuple[list[float], list[int]]:
    """Seconds per rep of `DistributedWeightSender.push` into the fake servers."""
    from rollout_bridge import SGLangEngine
    from rollout_bridge.sglang.broadcast import DistributedWeightSender, buckets

    client = SGLangEngine([s.url for s in servers], top_logprobs=1, timeout_s=600)
    sender = DistributedWeightSender(client, master_address="127.0.0.1", master_port=free_port(),
                                     backend="gloo", bucket_bytes=BUCKET_MB << 20,
                                     load_format=load_format, timeout_s=600)
    sizes = [b.nbytes for b in buckets(named, BUCKET_MB << 20)]
    try:
        sender.push(iter(named), "warmup")  # creates the group
        times = []
        for r in range(reps):
            t0 = time.perf_counter()
            sender.push(iter(named), f"v{r}")
            times.append(time.perf_counter() - t0)
    finally:
        sender.close()
    return times, sizes


# ------------------------------------------------------------------------------ disk


def disk_times(named, workdir: Path, reps: int) -> tuple[list[float], list[float]]:
    """(write seconds, read seconds) per rep: safetensors, one file per bucket, cold read."""
    from safetensors.torch import load_file, save_file

    from rollout_bridge.sglang.broadcast import buckets

    writes, reads = [], []
    for r in range(reps):
        d = workdir / f"disk{r}"
        d.mkdir()
        t0 = time.perf_counter()
        files = []
        for i, b in enumerate(buckets(named, BUCKET_MB << 20)):
            f = d / f"model-{i:05d}.safetensors"
            save_file(dict(zip(b.names, b.tensors)), str(f))
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            files.append(f)
        writes.append(time.perf_counter() - t0)
        for f in files:  # evict from the page cache: the read below comes from the disk
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        t0 = time.perf_counter()
        total = 0
        for f in files:
            total += sum(t.numel() for t in load_file(str(f)).values())
        reads.append(time.perf_counter() - t0)
        for f in files:
            f.unlink()
        d.rmdir()
    return writes, reads


# ------------------------------------------------------------------------------ main


def measure(label: str, named, args, workdir: Path) -> dict:
    from fake_proc import FakeServerProcess

    servers = [FakeServerProcess(str(workdir / f"{label}_s{i}"),
                                 ["--tiny-lm", "--receiver", "mirror", "--discard-weights"])
               for i in range(args.servers)]
    try:
        push, sizes = push_times(named, servers, args.reps)
        per_tensor, _ = push_times(named, servers, args.reps, load_format=None)
    finally:
        for s in servers:
            s.stop()
    bare = bare_broadcast(sizes, args.servers, args.reps, fresh=False)
    bare_fresh = bare_broadcast(sizes, args.servers, args.reps, fresh=True)
    write, read = disk_times(named, workdir, args.reps)
    med = statistics.median
    best = min(med(push), med(per_tensor))
    return {"label": label, "bytes": nbytes(named), "tensors": len(named), "buckets": len(sizes),
            "push_s": med(push), "push_per_tensor_s": med(per_tensor), "best_push_s": best,
            "bare_s": med(bare), "bare_fresh_s": med(bare_fresh), "disk_write_s": med(write),
            "disk_read_s": med(read), "push_over_bare": best / med(bare),
            "disk_over_push": (med(write) + med(read)) / best,
            "raw": {"push": push, "push_per_tensor": per_tensor, "bare": bare,
                    "bare_fresh": bare_fresh, "write": write, "read": read}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="Qwen3-30B-A3B decoder layers")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--servers", type=int, default=1, help="receiving server processes")
    ap.add_argument("--nccl-gbps", type=float, default=40.0,
                    help="assumed NCCL broadcast bandwidth for the projection, GB/s")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_ws_", dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        rows = [measure("tiny model (fp32)", tiny_model(), args, work)]
        rows.append(measure(f"Qwen3-30B-A3B, {args.layers} layer(s) (bf16)",
                            qwen3_layers(args.layers), args, work))
    big = rows[-1]
    total = qwen3_model_bytes()
    per_byte = {k: big[k] / big["bytes"] for k in ("best_push_s", "bare_s", "disk_write_s",
                                                    "disk_read_s")}
    extrap = {k: v * total for k, v in per_byte.items()}
    nccl_s = total / (args.nccl_gbps * 1e9)
    proj = {"model_bytes": total, "cpu_gloo_extrapolated_s": extrap,
            "nccl_gbps_assumed": args.nccl_gbps, "nccl_bare_s": nccl_s,
            "nccl_push_projected_s": nccl_s * big["push_over_bare"]}
    print(f"\nweight sync, {args.servers} server(s), gloo on 127.0.0.1, median of {args.reps}, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| tensors | MB | buckets | push s, flattened | push s, per tensor | bare s, buffers "
          "reused | bare s, fresh buffers | best push / bare reused | disk write s | disk read s "
          "| disk / best push |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['label']} | {r['bytes'] / 1e6:.1f} | {r['buckets']} | {r['push_s']:.3f} | "
              f"{r['push_per_tensor_s']:.3f} | {r['bare_s']:.3f} | {r['bare_fresh_s']:.3f} | "
              f"{r['push_over_bare']:.2f} | {r['disk_write_s']:.3f} | {r['disk_read_s']:.3f} | "
              f"{r['disk_over_push']:.2f} |")
    print(f"\nwhole Qwen3-30B-A3B, {total / 1e9:.1f} GB bf16, extrapolated per byte from the "
          f"layer row: best push {extrap['best_push_s']:.0f} s, bare {extrap['bare_s']:.0f} s, disk "
          f"{extrap['disk_write_s'] + extrap['disk_read_s']:.0f} s (gloo/CPU here)")
    print(f"projected per-iteration sync on GPUs at an assumed {args.nccl_gbps:.0f} GB/s NCCL "
          f"broadcast: bare {nccl_s:.2f} s, push {proj['nccl_push_projected_s']:.2f} s "
          f"(x measured best push / bare {big['push_over_bare']:.2f}; the trainer's gather "
          "excluded)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "projection": proj}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
