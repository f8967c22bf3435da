"""One GPU check for the cluster path, built to survive a bare machine (one GPU, one command).

    bash benchmarks/gpu_check.sh                       # installs the carried wheels, runs this
    python benchmarks/gpu_check.py --out gpu_check.json             # the check itself (CUDA)
    python benchmarks/gpu_check.py --smoke --out smoke.json         # tiny sizes on CPU (CI)

Every part runs in its own subprocess (`--part NAME`) under its own time budget, so a missing
dependency or a crash skips or fails that part only, with the reason in the JSON; the JSON file is
rewritten after every part. Parts:

1. correctness: `token_stats` (fp32 and bf16 logits, V=151936) against the same statistics of
   the fp64 logits, and the sampled log-probability against an fp64 `log_softmax`.
2. no_host_sync: the loss adapter's path (`mcore/loss_adapter.policy_loss_func`, validation off
   as for a validated batch) forward+backward under `torch.cuda.set_sync_debug_mode("error")`.
3. op_vs_ce: `token_stats`+`policy_loss` forward+backward vs megatron's
   `vocab_parallel_cross_entropy` (validation off): median time and peak memory, N in
   {8192, 32768}, V in {151936, 38016 (a TP4 shard of the padded vocabulary)}, bf16 and fp32, the ratio in the same run;
   for bf16 logits also the op on their fp32 copy (in place, as an fp32 LM-head output would
   feed it): the measurement behind the logits-dtype rule (docs/op.md).
4. op_matrix: the bf16 Qwen3 cells of the CPU matrix (benchmarks/op_matrix.py: N 2048 and 8192,
   TP 2, 4, 8 shards), `token_stats(inplace=True)` vs megatron's CE, paired alternating rounds
   and peak memory (benchmarks/gpu_op_matrix.py).
5. optimizer_step: one bf16 optimizer step of a 2-layer full-width Qwen3-30B-A3B slice through the
   driver's own functions (mcore.parallel.init_parallel, mcore.model, mcore.optimizer,
   train.schedule.optimizer_step with mcore.loss_adapter.make_loss_func).

`--smoke` runs the same parts with tiny sizes on the CPU (tests/benchmarks/test_gpu_check_parts.py);
parts that need CUDA report "skipped" there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpu_env import environment  # noqa: E402 (benchmarks/gpu_env.py)
from megatron_pdm.arch import vocab_shard_width  # noqa: E402 (pure: no torch)

V_QWEN3 = 151936
V_TP4_SHARD = vocab_shard_width(V_QWEN3, 128, 4)  # 38016: 151936 padded to 152064 (128*4), / 4

# part -> (seconds allowed on a GPU, seconds allowed in smoke mode); the sum stays inside 9 min
BUDGET_S = {"correctness": (60, 120), "no_host_sync": (60, 120), "op_vs_ce": (150, 180),
            "op_matrix": (120, 240), "optimizer_step": (150, 240)}


class Skip(Exception):
    """A part that cannot run here (the reason goes to the JSON)."""


def _sizes(smoke: bool) -> dict:
    if smoke:
        return dict(device="cpu", vocab=1000, tokens=16, bench_tokens=(32,), bench_vocab=(1000, 250),
                    iters=2, seq_len=16, matrix_tokens=(16,), matrix_rounds=1)
    return dict(device="cuda", vocab=V_QWEN3, tokens=2048, bench_tokens=(8192, 32768),
                bench_vocab=(V_QWEN3, V_TP4_SHARD), iters=5, seq_len=2048,
                matrix_tokens=(2048, 8192), matrix_rounds=7)


def synthetic_rollout(logits_nv, top_k: int, vocab_size: int, seed: int = 0) -> dict:
    """Support = behavior top-K of perturbed logits with the sampled token folded in at slot 0."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = logits_nv.shape[0]
    dev = logits_nv.device
    noise = torch.randn(logits_nv.shape, generator=gen).to(dev)
    behavior = (logits_nv.detach().float() + 0.1 * noise)[:, :vocab_size].log_softmax(-1)
    uniform = torch.rand(behavior.shape, generator=gen).clamp_min(1e-20).to(dev)
    sampled_n = (behavior - (-uniform.log()).log()).argmax(-1)
    top_nk = behavior.topk(top_k, dim=-1).indices
    support = torch.cat([sampled_n[:, None], top_nk], dim=1)
    dup = top_nk == sampled_n[:, None]
    valid = torch.cat([torch.ones(n, 1, dtype=torch.bool, device=dev), ~dup], dim=1)
    support_lp = behavior.gather(1, support)
    return dict(sampled_ids=sampled_n, support_ids=support, support_logprobs=support_lp,
                support_valid=valid, advantages=torch.randn(n, generator=gen).to(dev),
                behavior_logprob=support_lp[:, 0].clone(),
                loss_mask=torch.ones(n, dtype=torch.bool, device=dev))


def _pdm(logits_nv, b: dict, vocab: int, *, validate: bool, inplace: bool = False):
    import megatron_pdm as pdm

    stats = pdm.token_stats(logits_nv, b["sampled_ids"], b["support_ids"], b["support_logprobs"],
                            b["support_valid"], tp_group=None, vocab_size=vocab,
                            validate=validate, inplace=inplace)
    out = pdm.policy_loss(stats, b["advantages"], b["behavior_logprob"], b["loss_mask"],
                          pdm.PolicyLossConfig.preset("pdm-agg"))
    return stats, out


# ---------------------------------------------------------------- parts (each in a subprocess)

def part_correctness(sz: dict) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    base_nv = (3 * torch.randn(sz["tokens"], sz["vocab"], generator=gen, dtype=torch.float64))
    base_nv = base_nv.to(sz["device"])
    batch = synthetic_rollout(base_nv, top_k=20, vocab_size=sz["vocab"])
    ref_stats, _ = _pdm(base_nv, batch, sz["vocab"], validate=True)
    lp_ref = base_nv.log_softmax(-1).gather(1, batch["sampled_ids"][:, None])[:, 0]
    out = {"tokens": sz["tokens"], "vocab": sz["vocab"]}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = base_nv.to(dtype)
        stats, _ = _pdm(x, batch, sz["vocab"], validate=True)
        # the reference of a rounded input is the fp64 statistics of that rounded input
        ref_x, _ = _pdm(x.double(), batch, sz["vocab"], validate=True)
        diffs = {}
        for field, value in vars(stats).items():
            ref = getattr(ref_x, field)
            if torch.is_tensor(value) and value.is_floating_point():
                finite = torch.isfinite(ref)
                same = torch.equal(finite, torch.isfinite(value))
                diffs[field] = ((value.double()[finite] - ref[finite]).abs().max().item()
                                if same and finite.any() else (0.0 if same else float("inf")))
        lp_x = x.double().log_softmax(-1).gather(1, batch["sampled_ids"][:, None])[:, 0]
        diffs["logprob_vs_log_softmax"] = (stats.logprob.double() - lp_x).abs().max().item()
        out[name] = {"max_abs_diff": diffs, "worst": max(diffs.values())}
    out["fp64_logprob_vs_log_softmax"] = (ref_stats.logprob - lp_ref).abs().max().item()
    return out


def part_no_host_sync(sz: dict) -> dict:
    import torch

    if sz["device"] != "cuda" or not torch.cuda.is_available():
        raise Skip("torch.cuda.set_sync_debug_mode needs a CUDA device")
    from megatron_pdm.config import PolicyLossConfig
    from megatron_pdm.mcore.loss_adapter import policy_loss_func

    b, s = 2, sz["tokens"] // 2
    gen = torch.Generator().manual_seed(0)
    logits_bsv = (3 * torch.randn(b, s, sz["vocab"], generator=gen)).to("cuda")
    flat = synthetic_rollout(logits_bsv.reshape(b * s, -1), top_k=20, vocab_size=sz["vocab"])
    batch = SimpleNamespace(
        labels=flat["sampled_ids"].reshape(b, s), loss_mask=flat["loss_mask"].reshape(b, s),
        behavior_logprob=flat["behavior_logprob"].reshape(b, s),
        support_ids=flat["support_ids"].reshape(b, s, -1),
        support_logprobs=flat["support_logprobs"].reshape(b, s, -1),
        support_valid=flat["support_valid"].reshape(b, s, -1),
        advantages=flat["advantages"].reshape(b, s),
        seq_ids=torch.arange(b, device="cuda")[:, None].expand(b, s).contiguous(),
        temperature=1.0, vocab_size=sz["vocab"], validated=True)
    cfg = PolicyLossConfig.preset("pdm-agg")
    results = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = logits_bsv.to(dtype).requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss_sum, num_tokens, _ = policy_loss_func(x, batch=batch, cfg=cfg, tp_group=None,
                                                       inplace=False)
            loss_sum.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        results[name] = {"host_syncs": 0, "loss_finite": bool(torch.isfinite(loss_sum).item())}
    return results


def _median_ms_and_peak(fn, iters: int, cuda: bool) -> tuple[float, float | None]:
    import torch

    fn()  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return sorted(times)[len(times) // 2], peak


def part_op_vs_ce(sz: dict) -> dict:
    import torch

    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # Skip if absent

    from megatron_pdm.mcore.parallel import init_parallel

    _single_rank_env()
    init_parallel(tp=1, ep=1, pp=1)
    cuda = sz["device"] == "cuda"
    rows = []
    for tokens in sz["bench_tokens"]:
        for vocab in sz["bench_vocab"]:
            for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                gen = torch.Generator().manual_seed(0)
                logits = (3 * torch.randn(tokens, vocab, generator=gen)).to(sz["device"], dtype)
                batch = synthetic_rollout(logits, top_k=20, vocab_size=vocab)

                def run_pdm():
                    x = logits.detach().requires_grad_(True)
                    _, out = _pdm(x, batch, vocab, validate=False)
                    out[0].backward()

                def run_ce():
                    x = logits.detach().requires_grad_(True)
                    vocab_parallel_cross_entropy(x[:, None], batch["sampled_ids"][:, None]
                                                 ).sum().backward()

                def run_pdm_fp32():  # bf16 logits cast to fp32 (an fp32 LM-head output)
                    x = logits.detach().requires_grad_(True)
                    _, out = _pdm(x.float(), batch, vocab, validate=False, inplace=True)
                    out[0].backward()

                pdm_ms, pdm_gib = _median_ms_and_peak(run_pdm, sz["iters"], cuda)
                ce_ms, ce_gib = _median_ms_and_peak(run_ce, sz["iters"], cuda)
                row = {"tokens": tokens, "vocab": vocab, "dtype": name,
                       "pdm_ms": pdm_ms, "ce_ms": ce_ms, "ratio_time": pdm_ms / ce_ms,
                       "pdm_peak_gib": pdm_gib, "ce_peak_gib": ce_gib,
                       "ratio_memory": (pdm_gib / ce_gib) if cuda and ce_gib else None}
                if dtype is torch.bfloat16:  # the logits-dtype decision (docs/op.md)
                    cast_ms, cast_gib = _median_ms_and_peak(run_pdm_fp32, sz["iters"], cuda)
                    row.update(pdm_fp32_cast_ms=cast_ms, pdm_fp32_cast_peak_gib=cast_gib,
                               ratio_time_cast_vs_bf16=cast_ms / pdm_ms,
                               ratio_memory_cast_vs_bf16=(cast_gib / pdm_gib)
                               if cuda and pdm_gib else None)
                rows.append(row)
                del logits, batch
    return {"rows": rows, "iters": sz["iters"], "validate": False}


def part_op_matrix(sz: dict) -> dict:
    """The bf16 Qwen3 cells of benchmarks/op_matrix.py, paired (benchmarks/gpu_op_matrix.py)."""
    from gpu_op_matrix import run_matrix  # benchmarks/ is on sys.path (the script's folder)

    from megatron_pdm.mcore.parallel import init_parallel

    _single_rank_env()
    init_parallel(tp=1, ep=1, pp=1)
    return run_matrix(sz)


def part_optimizer_step(sz: dict) -> dict:
    import torch

    from megatron_pdm.arch import ModelArch
    from megatron_pdm.config import PolicyLossConfig
    from megatron_pdm.mcore import optimizer as mopt
    from megatron_pdm.mcore.device import place
    from megatron_pdm.mcore.loss_adapter import make_loss_func
    from megatron_pdm.mcore.model import build_model, transformer_config
    from megatron_pdm.mcore.parallel import init_parallel
    from megatron_pdm.train.schedule import optimizer_step

    smoke = sz["device"] == "cpu"
    _single_rank_env()
    init_parallel(tp=1, ep=1, pp=1)
    arch = ModelArch(vocab_size=1000) if smoke else ModelArch.qwen3_30b_a3b()
    arch.num_layers = 2
    dtype = dict(params_dtype=torch.float32) if smoke else dict(params_dtype=torch.bfloat16,
                                                                bf16=True)
    config = transformer_config(arch, calculate_per_token_loss=True, **dtype)
    model = place(build_model(arch, config))  # as the trainer places it
    ddp = mopt.wrap_ddp(model, config, use_distributed_optimizer=True)
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    opt = mopt.build_optimizer(ddp, lr=1e-6, weight_decay=0.1, clip_grad=1.0,
                               use_distributed_optimizer=True,
                               params_dtype="fp32" if smoke else "bf16")
    dev = next(p for p in model.parameters()).device
    s = sz["seq_len"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (1, s), generator=gen).to(dev)
    fake_logits = torch.randn(s, arch.vocab_size, generator=gen).to(dev)
    flat = synthetic_rollout(fake_logits, top_k=20, vocab_size=arch.vocab_size)
    from rollout_bridge import PackedBatch

    mb = PackedBatch(  # the driver's batch type (its forward step moves it to the device)
        tokens=tokens, position_ids=torch.arange(s, device=dev)[None],
        labels=flat["sampled_ids"][None], loss_mask=flat["loss_mask"][None],
        behavior_logprob=flat["behavior_logprob"][None], support_ids=flat["support_ids"][None],
        support_logprobs=flat["support_logprobs"][None],
        support_valid=flat["support_valid"][None], advantages=flat["advantages"][None],
        seq_ids=torch.zeros(1, s, dtype=torch.long, device=dev), temperature=1.0,
        weight_version=None, vocab_size=arch.vocab_size, validated=False)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    store, grad_norm = optimizer_step(ddp, opt, [mb], lambda m: make_loss_func(
        m, PolicyLossConfig.preset("pdm-agg")), pp=1)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    changed = sum(int(not torch.equal(before[n], p.detach().float()))
                  for n, p in model.named_parameters())
    return {"layers": arch.num_layers, "hidden_size": arch.hidden_size,
            "num_experts": arch.num_experts, "vocab": arch.vocab_size, "seq_len": s,
            "params_dtype": "fp32" if smoke else "bf16", "device": str(dev),
            "grad_norm": grad_norm, "grad_norm_finite": grad_norm == grad_norm and
            abs(grad_norm) != float("inf"), "params_changed": changed,
            "params_total": len(before), "step_s": seconds,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


PARTS = {"correctness": part_correctness, "no_host_sync": part_no_host_sync,
         "op_vs_ce": part_op_vs_ce, "op_matrix": part_op_matrix,
         "optimizer_step": part_optimizer_step}


def _single_rank_env() -> None:
    """torch.distributed env for a one-process world (a free port on loopback: one machine)."""
    from megatron_pdm.netutil import free_port

    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def run_part(name: str, smoke: bool) -> dict:
    """Runs one part in this process: {"status": ok|skipped|failed, "reason", "result"}."""
    try:
        return {"status": "ok", "result": PARTS[name](_sizes(smoke))}
    except Skip as why:
        return {"status": "skipped", "reason": str(why)}
    except ImportError as err:  # a dependency missing on this machine skips this part only
        return {"status": "skipped", "reason": f"missing dependency: {err}"}
    except Exception as err:  # noqa: BLE001 - the reason goes to the JSON, other parts go on
        return {"status": "failed", "reason": f"{type(err).__name__}: {err}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # child: one part to stdout
    args = p.parse_args(argv)
    if args.part:
        print(json.dumps(run_part(args.part, args.smoke)))
        return 0
    out = Path(args.out)
    report = {"mode": "smoke" if args.smoke else "gpu", "environment": environment(),
              "parts": {}}
    wanted = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {unknown}, choose from {list(PARTS)}")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in wanted:
        budget = BUDGET_S[name][1 if args.smoke else 0]
        t0 = time.perf_counter()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name]
        cmd += ["--smoke"] if args.smoke else []
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget)
            lines = proc.stdout.strip().splitlines()
            try:
                entry = json.loads(lines[-1])
            except (IndexError, json.JSONDecodeError):
                entry = {"status": "failed",
                         "reason": f"exit code {proc.returncode}: {proc.stderr[-2000:]}"}
        except subprocess.TimeoutExpired:
            entry = {"status": "failed", "reason": f"over its budget of {budget} s"}
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        entry["budget_s"] = budget
        report["parts"][name] = entry
        out.write_text(json.dumps(report, indent=2) + "\n")  # after every part
        print(f"gpu_check: {name}: {entry['status']} ({entry['seconds']} s)"
              + (f": {entry['reason'][:300]}" if "reason" in entry else ""), flush=True)
    return 0 if all(e["status"] != "failed" for e in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
