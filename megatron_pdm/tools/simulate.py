"""`megatron-pdm-simulate`: one RL optimizer step of a recipe per simulated rank, on fake tensors.

Usage (the driver's own arguments, e.g. what a cluster script passes to it):

    megatron-pdm-simulate --world 8 --output-dir results/simulate/run \\
        $(bash examples/qwen3_30b_a3b/train_pdm.sh --print-args)

For each `--ranks` entry it builds the trainer's model, DDP wrapper and optimizer at the
recipe's real shapes on fake tensors (megatron_pdm/train/simulate.py, mcore/fake_sim.py), runs
one optimizer step on a synthetic micro-batch of the recipe's size (`--dry-run`'s micro-batch
rule) and writes `simulate.json` and `simulate.md` to `--output-dir`: per rank the bytes of
parameters, gradient buffers, optimizer state and the activation peak beside `--dry-run`'s
estimate (megatron_pdm.layout, local layer spec: the one simulated), the parameter and loss-input
shape checks, the stand-ins used, every collective (grouped in the json and the md, call by call
in `collectives.csv`: mcore/sim_collectives.py), the device violations (a host tensor meeting a
device one: mcore/sim_devices.py) and each rank's checkpoint save plan; with `--convert-plan`
also the conversion plan, the checkpoint's coverage and the weight-sync bucket plan of the whole
world (train/sim_plans.py). An FP8 recipe runs with the stand-ins of mcore/sim_fp8.py (TE's FP8
GEMM shape rule on the layers' linears, TE's FP8 weight copies as their own memory category). The
packed length is padded by the driver's rule (`model_setup.seq_multiple`). Exit code 1 when a
shape, FP8 GEMM or plan check fails or a device violation is found. docs/simulate.md says
what this proves and what it cannot.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from megatron_pdm import layout
from megatron_pdm.hostinfo import cpu_model
from megatron_pdm.intmath import round_up
from megatron_pdm.train import dry_run
from megatron_pdm.train import model_setup as ms
from megatron_pdm.train import sim_plans
from megatron_pdm.train import simulate as sim
from megatron_pdm.train.config import RunConfig

GIB = 2**30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-pdm-simulate", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's yaml (as for megatron-pdm-train)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (as for megatron-pdm-train), repeatable")
    p.add_argument("--world", type=int, required=True, help="simulated world size (GPUs)")
    p.add_argument("--ranks", default="0", help="comma-separated simulated ranks (default 0)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="fewer layers than the model's (a reduced run; default: the model's)")
    p.add_argument("--num-experts", type=int, default=None,
                   help="fewer experts than the model's (a reduced run; default: the model's)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="tokens per sample (default rollout.max_sequence_length)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per micro-batch (default: --dry-run's rule for this world)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="micro-batches in the simulated step (default 1; with PP 1 the peak "
                        "does not grow with more)")
    p.add_argument("--convert-plan", action="store_true",
                   help="also build the fake model of every rank of the world and check the "
                        "converter's name and shard mapping, the checkpoint's coverage and the "
                        "weight-sync bucket plan (train/sim_plans.py)")
    p.add_argument("--no-step", action="store_true",
                   help="with --convert-plan: skip the simulated step (no per-rank memory or "
                        "optimizer save plan)")
    p.add_argument("--output-dir", default=None, help="write simulate.json / simulate.md here")
    return p


def dry_run_estimate(cfg: RunConfig, arch, lay, *, micro: int, seq: int) -> dict:
    """`--dry-run`'s per-GPU estimate (bytes) with the simulated (local) layer spec; with FP8
    its weights term is split into the params-dtype weights and the FP8 copies."""
    def estimate(fp8: bool):
        return layout.estimate_memory(
            arch, lay, micro_batch_size=micro, seq_length=seq,
            params_dtype=cfg.precision.params_dtype, fp8=fp8,
            distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            recompute=cfg.train.recompute, num_microbatches=cfg.train.microbatches_per_minibatch,
            attention="local", fused_head_chunk=dry_run._fused_head_chunk(cfg))

    est = estimate(cfg.precision.fp8 is not None)
    fp8_copies = est.weights - estimate(False).weights
    return {"weights": est.weights - fp8_copies, "fp8_weight_copies": fp8_copies,
            "grads": est.grads, "optimizer": est.optimizer,
            "activations": est.activations, "logits": est.logits,
            "attention_scores": est.attention_scores, "total": est.total,
            "params": est.dense_params + est.expert_params}


def compare(rank_report: dict, est: dict) -> list[dict]:
    """Rows simulated vs estimated (bytes), with the relative difference."""
    b = rank_report["bytes"]
    act_est = est["activations"] + est["logits"] + est["attention_scores"]
    rows = [("parameters", b["parameters"], est["weights"]),
            ("gradients", b["gradients"], est["grads"]),
            ("optimizer state", b["optimizer_main_params"] + b["optimizer_adam_state"],
             est["optimizer"]),
            ("activations + logits (peak)", b["activations_peak"], act_est)]
    if "fp8" in rank_report:
        rows.insert(1, ("fp8 weight copies", b["fp8_weight_copies"], est["fp8_weight_copies"]))
    total = sum(r[1] for r in rows)
    rows.append(("total", total, est["total"]))
    return [{"category": c, "simulated": s, "dry_run": e,
             "diff": (s - e) / e if e else None} for c, s, e in rows]


def _markdown(result: dict) -> str:
    lines = [f"# Simulated step: {result['recipe']}", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}; wall time {result['wall_s']} s (fake tensors; "
             "timings under load from other jobs).", "",
             f"Layout: world {result['world']}, TP {result['tp']}, EP {result['ep']}, "
             f"PP {result['pp']}, DP {result['dp']}; micro-batch {result['micro_batch']} x "
             f"{result['seq_length']} tokens{_padding_text(result)}, top-K {result['top_k']}, "
             f"{result['num_layers']} "
             f"layers, {result['num_experts']} experts, vocabulary {result['vocab_size']} "
             f"padded to {result['padded_vocab']} ({result['vocab_shard']} per TP rank).", ""]
    for r in result["ranks"]:
        lines += [f"## Rank {r['rank']} (tp {r['ranks']['tp']}, ep {r['ranks']['ep']}, "
                  f"pp {r['ranks']['pp']}, dp {r['ranks']['dp']})", "",
                  "| category | simulated GiB | dry-run GiB | difference |",
                  "|---|---:|---:|---:|"]
        for row in r["compare"]:
            diff = "" if row["diff"] is None else f"{100 * row['diff']:+.1f}%"
            lines.append(f"| {row['category']} | {row['simulated'] / GIB:.2f} | "
                         f"{row['dry_run'] / GIB:.2f} | {diff} |")
        b = r["bytes"]
        lines += ["", f"- parameters: {r['num_params']:,} local ({r['dry_run_params']:,} "
                  "by the dry-run's count); shape problems: "
                  f"{len(r['param_shape_problems']) + len(r['loss_input_problems'])}",
                  f"- loss op input {r['loss_inputs'].get('output_tensor')} "
                  f"{r['loss_inputs'].get('output_dtype', '')}; loss forward peak "
                  f"{b['loss_forward_peak'] / GIB:.3f} GiB; peak of the whole step above the "
                  f"static bytes (the optimizer step included) {b['optimizer_step_peak'] / GIB:.2f} GiB",
                  f"- largest live tensors at the activation peak: " + ", ".join(
                      f"{t['op']} {t['bytes'] / GIB:.2f} GiB" for t in r["activations_peak_top"][:4]),
                  f"- checkpoint save plan (nothing written): this rank writes "
                  f"{r['checkpoint_plan']['bytes']['model'] / GIB:.2f} GiB model + "
                  f"{r['checkpoint_plan']['bytes']['optimizer'] / GIB:.2f} GiB optimizer state; "
                  f"problems: {len(r['checkpoint_plan']['optimizer_problems'])}",
                  f"- stand-ins: {r['stand_ins']['scalar_reads']} host scalar reads answered by a "
                  f"placeholder, {r['stand_ins']['cuda_factories_on_cpu']} device='cuda' "
                  "factories made on CPU", ""]
        lines += _fp8_lines(r)
        lines += _collective_lines(r)
    return "\n".join(lines)


def _padding_text(result: dict) -> str:
    """The sequence padding and the FP8 setting (absent from reports written before them)."""
    if "seq_multiple" not in result:
        return ""
    fp8 = f"FP8 {result['fp8']} ({result['fp8_recipe']})" if result["fp8"] else "FP8 off"
    return (f" (requested {result['seq_length_requested']}, padded to a multiple of "
            f"{result['seq_multiple']}), {fp8}")


def _fp8_lines(r: dict) -> list[str]:
    """The FP8 stand-ins' results (mcore/sim_fp8.py): GEMM shape checks, FP8 weight copies."""
    f = r.get("fp8")
    if f is None:
        return []
    g, w = f["gemm_check"], f["weight_copies"]
    lines = [f"### FP8 ({f['format']}, {f['recipe']}): stand-ins F1 and F2", "",
             "F1: the local spec's bf16 linears stand in for TE's FP8 linears; TE's shape rule "
             f"checked on every FP8 GEMM operand (rows % 8, last dim % 16; inputs: rows a "
             f"multiple of {g['row_alignment']}; expert rows after megatron's FP8 padding to "
             f"{g['expert_row_padding']}).", "",
             "| module kind | modules | forward calls | backward calls | inputs | raw rows "
             "(experts) | weights | output gradients |", "|---|---:|---:|---:|---|---|---|---|"]
    def shapes(ss):
        return ", ".join("x".join(map(str, s)) for s in ss)
    for kind, k in g["kinds"].items():
        lines.append(f"| {kind} | {k['modules']} | {k['forward_calls']} | {k['backward_calls']} "
                     f"| {shapes(k['input_shapes'])} | "
                     f"{', '.join(map(str, k['raw_input_rows'])) if '*' in kind else ''} | "
                     f"{shapes(k['weight_shapes'])} | {shapes(k['grad_shapes'])} |")
    lines += ["", f"GEMM shape violations: {len(g['violations'])}"]
    lines += [f"- FP8 ERROR {v['count']}x {v['module']}: {v['problem']}" for v in g["violations"]]
    scales = " + fp32 128x128-block scales" if f["recipe"] == "blockwise" else ""
    lines += ["", f"F2: TE's FP8 weight copies, {w['weights']} linear weights ({w['tensors']} "
              f"tensors: uint8 data{scales}), "
              f"{w['bytes'] / GIB:.3f} GiB, held through the step (the activation peak above "
              f"is without them; with them {f['step_peak_with_weight_copies'] / GIB:.2f} GiB).",
              "", "Not shown by the FP8 simulation:"]
    return lines + [f"- {n}" for n in f["not_shown"]] + [""]


def _collective_lines(r: dict) -> list[str]:
    """The rank's collectives per (phase, op, group, shape): count and bytes per iteration."""
    lines = ["### Collectives (one iteration)", "",
             "Tensors in c10d's argument order (a gather or scatter: output, input). Bytes: the "
             "largest tensor of the call (the gathered / scattered whole); a group of 1 moves "
             "nothing on the wire.", "",
             "| phase | op | group (size: ranks) | tensors | dtype | count | MiB per call | "
             "MiB total | call site |", "|---|---|---|---|---|---:|---:|---:|---|"]
    for c in r["collectives"]:
        g = r["collective_groups"].get(c["group"], {})
        op = c["op"] + (f" {c['reduce_op']}" if c["reduce_op"] else "")
        shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in c["shapes"])
        lines.append(f"| {c['phase']} | {op} | {c['kind']} ({g.get('size')}: "
                     f"{g.get('ranks')}) | {shapes} | {c['dtype']} | {c['count']} | "
                     f"{c['bytes_per_call'] / 2**20:.3f} | {c['bytes_total'] / 2**20:.1f} | "
                     f"{'; '.join(c['sites'])} |")
    lines += ["", f"{r['collective_calls']} collective calls; device violations: "
              f"{len(r['device_violations'])} ({r['device_ops']:,} ops on device tensors checked)"]
    lines += [f"- DEVICE {v['count']}x {v['what']} at {v['project_frame']} "
              f"(innermost: {v['caller']})" for v in r["device_violations"]]
    return lines + [""]


def _write_calls(path: str, ranks: list[dict]) -> None:
    """Every collective call of every simulated rank, in issue order (CSV)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "phase", "op", "reduce_op", "group", "shapes", "dtype", "bytes",
                    "caller", "project_frame"])
        for r in ranks:
            for c in r["collective_calls"]:
                w.writerow([r["rank"], c["phase"], c["op"], c["reduce_op"], c["group"],
                            " ".join("x".join(map(str, s)) for s in c["shapes"]), c["dtype"],
                            c["bytes"], c["caller"], c["project_frame"]])


def rewrite_markdown(output_dir: str) -> None:
    """`simulate.md` again from the directory's `simulate.json` (a report format change)."""
    with open(os.path.join(output_dir, "simulate.json")) as f:
        result = json.load(f)
    with open(os.path.join(output_dir, "simulate.md"), "w") as f:
        f.write(_markdown(result))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = RunConfig.load(args.config, args.set)
    p = cfg.parallel
    arch = sim.with_layers(cfg.model, args.num_layers, args.num_experts)
    arch.require_vocab()
    lay = layout.validate_layout(arch, world_size=args.world, tp=p.tp, pp=p.pp, ep=p.ep, etp=1)
    micro = args.micro_batch or dry_run.micro_batch_size(cfg, lay.dp)
    seq_requested = args.seq_length or cfg.rollout.max_sequence_length
    if not seq_requested:
        raise SystemExit("simulate: set rollout.max_sequence_length or --seq-length")
    # the driver's padding rule (trainer: pack_padded(pad_to_multiple_of=ms.seq_multiple(cfg)))
    seq = round_up(seq_requested, ms.seq_multiple(cfg))
    est = dry_run_estimate(cfg, arch, lay, micro=micro, seq=seq)
    t0 = time.time()
    ranks, failed, own_records = [], False, {}
    if args.no_step and not args.convert_plan:
        raise SystemExit("simulate: --no-step only with --convert-plan")
    for rank in [] if args.no_step else [int(r) for r in args.ranks.split(",")]:
        r = sim.simulate_rank(cfg, arch, rank=rank, world=args.world, micro_batch=micro,
                              seq_length=seq, microbatches=args.microbatches)
        r["loss_input_problems"] = sim.check_loss_inputs(
            r, arch, tp=p.tp, micro_batch=micro, seq_length=seq, fused_head=cfg.train.fused_head)
        r["dry_run_params"] = est["params"]
        r["compare"] = compare(r, est)
        own_records[rank] = r["checkpoint_plan"].pop("model_records")
        fp8_violations = r["fp8"]["gemm_check"]["violations"] if "fp8" in r else []
        failed |= bool(r["param_shape_problems"] or r["loss_input_problems"] or fp8_violations
                       or r["device_violations"] or r["checkpoint_plan"]["optimizer_problems"])
        ranks.append(r)
        print(f"rank {rank}: " + ", ".join(f"{row['category']} {row['simulated'] / GIB:.2f} GiB "
                                           f"(dry-run {row['dry_run'] / GIB:.2f})"
                                           for row in r["compare"]), flush=True)
        for problem in r["param_shape_problems"] + r["loss_input_problems"]:
            print(f"rank {rank}: SHAPE {problem}", flush=True)
        for v in r["device_violations"]:
            print(f"rank {rank}: DEVICE {v['count']}x {v['what']} at {v['project_frame']} "
                  f"(innermost: {v['caller']})", flush=True)
        for v in fp8_violations:
            print(f"rank {rank}: FP8 {v['count']}x {v['module']}: {v['problem']}", flush=True)
        for problem in r["checkpoint_plan"]["optimizer_problems"]:
            print(f"rank {rank}: CHECKPOINT {problem}", flush=True)
    plan_section = None
    if args.convert_plan:
        plan_section = sim_plans.plans(cfg, arch, args.world, ranks, own_records)
        for problem in sim_plans.problems(plan_section):
            print(f"PLAN {problem}", flush=True)
        failed |= bool(sim_plans.problems(plan_section))
    result = {"recipe": args.config, "command": "megatron-pdm-simulate " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "machine": f"{cpu_model()}, {os.cpu_count()} cores, "
                         f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
              "wall_s": round(time.time() - t0, 1), "world": args.world, "tp": p.tp, "ep": p.ep,
              "pp": p.pp, "dp": lay.dp, "micro_batch": micro, "seq_length": seq,
              "seq_length_requested": seq_requested, "seq_multiple": ms.seq_multiple(cfg),
              "fp8": cfg.precision.fp8, "fp8_recipe": cfg.precision.fp8_recipe,
              "microbatches": args.microbatches, "top_k": cfg.rollout.top_logprobs,
              "num_layers": arch.num_layers, "num_experts": arch.num_experts,
              "vocab_size": arch.vocab_size, "padded_vocab": lay.padded_vocab_size,
              "vocab_shard": lay.padded_vocab_size // p.tp, "dry_run": est, "ranks": ranks}
    if plan_section is not None:
        result["plans"] = plan_section
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        _write_calls(os.path.join(args.output_dir, "collectives.csv"), ranks)
    for r in ranks:  # every call is in collectives.csv; the json keeps the grouped rows
        r["collective_calls"] = len(r["collective_calls"])
    if args.output_dir:
        with open(os.path.join(args.output_dir, "simulate.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.output_dir, "simulate.md"), "w") as f:
            f.write(_markdown(result) + ("\n".join(sim_plans.markdown(plan_section))
                                         if plan_section is not None else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
