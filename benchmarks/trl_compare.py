"""Pure parts of benchmarks/bench_trl_grpo.py (no TRL import): the shared settings of the two
sides, their mapping onto TRL's `GRPOConfig`, the per-run summary and the ratio table.

The comparison runs the same work on both sides: the same model directory, the same training
prompts in the same order (`WordProblemTask.problems(seed, k, prompts_per_iteration)` for
iteration k), the same samples per prompt, response length, temperature, learning rate, Adam
betas, clipping, one optimizer step per rollout batch (split into the same micro-batches), the
same advantages (reward minus the group mean, no std scaling: Dr.GRPO, `group_advantages`) and
the same token-mean loss over the batch. What differs is stated by `DIFFERENCES`.
"""

from __future__ import annotations

import math
import statistics

SHARED_KEYS = ("seed", "iterations", "prompts_per_iteration", "group_size", "max_new_tokens",
               "temperature", "lr", "clip_grad", "adam_beta1", "adam_beta2", "weight_decay",
               "microbatches", "eval_prompts", "max_operand", "heldout_fraction")

DIFFERENCES = (
    "generation: this project's driver samples with a vLLM CPU server (fp32, its own process) "
    "and pushes the trainer's weights to it after every step; TRL generates with HF transformers "
    "`generate` inside the training process (TRL's vLLM modes need CUDA)",
    "trainer: megatron-core GPT model (TP 1, fp32) against the HF LlamaForCausalLM (fp32, sdpa)",
    "threads: rollout and step take turns on both sides; the driver's trainer has "
    "OMP_NUM_THREADS=`--threads` (2 by default) and vLLM's worker VLLM_CPU_NUM_OF_RESERVED_CPU="
    "`--vllm-reserved` (0 by default: every core); TRL's single process gets torch threads = "
    "`--trl-threads` (2 by default): the same 2 cores",
    "loss: the driver's GRPO preset clips pi/mu with mu = vLLM's sampling log-probs; TRL's with "
    "num_iterations=1 uses its own detached log-probs (ratio exactly 1); PDM adds its trust "
    "region on the top-K support",
    "evaluation: the same held-out problems; the driver evaluates through vLLM in its run "
    "(greedy, and sampled with train.eval_samples); TRL's side through HF generate (greedy), or, "
    "after `eval`, its saved weights through the driver's own vLLM evaluation (trl.json 'eval')",
)


def shared_settings(cfg: dict) -> dict:
    """The settings both sides use, from a driver config dict (`RunConfig.to_dict()` / yaml)."""
    r, t, task = cfg["rollout"], cfg["train"], cfg["task"]
    if t.get("minibatches_per_iteration", 1) != 1 or t.get("epochs_per_batch", 1) != 1:
        raise ValueError("the comparison needs one optimizer step per rollout batch "
                         "(train.minibatches_per_iteration=1, train.epochs_per_batch=1)")
    out = {"seed": int(cfg["seed"]), "iterations": int(t["iterations"]),
           "prompts_per_iteration": int(r["prompts_per_iteration"]),
           "group_size": int(r["group_size"]), "max_new_tokens": int(r["max_new_tokens"]),
           "temperature": float(r["temperature"]), "lr": float(t["lr"]),
           "clip_grad": float(t["clip_grad"]), "adam_beta1": float(t.get("adam_beta1", 0.9)),
           "adam_beta2": float(t.get("adam_beta2", 0.99)),
           "weight_decay": float(t.get("weight_decay", 0.0)),
           "microbatches": int(t.get("microbatches_per_minibatch", 1)),
           "eval_prompts": int(t["eval_prompts"]), "max_operand": int(task["max_operand"]),
           "heldout_fraction": float(task.get("heldout_fraction", 0.2))}
    if t.get("lr_warmup_steps", 0):
        raise ValueError("train.lr_warmup_steps must be 0 for the comparison (constant lr)")
    return out


def grpo_config_kwargs(shared: dict, *, output_dir: str) -> dict:
    """TRL `GRPOConfig` keyword arguments doing the driver's work (module docstring)."""
    samples = shared["prompts_per_iteration"] * shared["group_size"]
    mbs = shared["microbatches"]
    if samples % mbs:
        raise ValueError(f"prompts x group ({samples}) must divide by the micro-batches ({mbs})")
    return dict(
        output_dir=output_dir, seed=shared["seed"], max_steps=shared["iterations"],
        per_device_train_batch_size=samples // mbs, gradient_accumulation_steps=mbs,
        steps_per_generation=mbs,  # one generation batch = one optimizer step
        num_generations=shared["group_size"], num_iterations=1,
        max_completion_length=shared["max_new_tokens"], temperature=shared["temperature"],
        top_p=1.0, learning_rate=shared["lr"], lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=shared["clip_grad"], adam_beta1=shared["adam_beta1"],
        adam_beta2=shared["adam_beta2"], adam_epsilon=1e-8, weight_decay=shared["weight_decay"],
        beta=0.0,  # no KL to a reference model (the driver has none)
        loss_type="dapo",  # token mean over the whole batch (the driver's "token-mean")
        scale_rewards="none",  # reward minus the group mean (group_advantages)
        epsilon=0.2, epsilon_high=0.28,  # the grpo preset's clip (inactive at ratio 1)
        gradient_checkpointing=False,  # TRL's default is True; the driver recomputes nothing
        shuffle_dataset=False, use_vllm=False, bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False,
    )


def run_summary(name: str, iteration_s: list[float], response_tokens: list[int],
                acc_before: tuple[int, int], acc_after: tuple[int, int], **extra) -> dict:
    """One side's numbers: seconds per iteration (median and mean), generated tokens per second
    of iteration time, held-out greedy accuracy before / after as (correct, n)."""
    if not iteration_s or len(iteration_s) != len(response_tokens):
        raise ValueError(f"{name}: need one response-token count per timed iteration, got "
                         f"{len(iteration_s)} times and {len(response_tokens)} counts")
    total = sum(iteration_s)
    return {"name": name, "iterations": len(iteration_s), "iteration_s": list(iteration_s),
            "s_per_iter_median": statistics.median(iteration_s),
            "s_per_iter_mean": total / len(iteration_s),
            "response_tokens": list(response_tokens),
            "tokens_per_s": sum(response_tokens) / total if total > 0 else math.nan,
            "acc_before": list(acc_before), "acc_after": list(acc_after), **extra}


def _acc(pair) -> float:
    c, n = pair
    return c / n if n else math.nan


def ratio_rows(runs: list[dict], baseline: str) -> list[dict]:
    """Per run: its numbers and their ratio to the baseline run's (same session)."""
    base = {r["name"]: r for r in runs}.get(baseline)
    if base is None:
        raise ValueError(f"baseline {baseline!r} is not among the runs {[r['name'] for r in runs]}")
    rows = []
    for r in runs:
        row = {"name": r["name"], "s_per_iter_median": r["s_per_iter_median"],
               "tokens_per_s": r["tokens_per_s"], "acc_before": _acc(r["acc_before"]),
               "acc_after": _acc(r["acc_after"]), "n_eval": r["acc_after"][1]}
        row["speedup_vs_" + baseline] = _div(base["s_per_iter_median"], r["s_per_iter_median"])
        row["tokens_per_s_ratio"] = _div(r["tokens_per_s"], base["tokens_per_s"])
        row["acc_after_diff"] = row["acc_after"] - _acc(base["acc_after"])
        rows.append(row)
    return rows


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def markdown_table(rows: list[dict], baseline: str) -> str:
    """The ratio table as markdown (one line per run)."""
    head = ("| run | s / iteration (median) | speed-up vs " + baseline + " | generated tokens / s "
            "| tokens/s ratio | held-out greedy before | after | after minus " + baseline + " |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['s_per_iter_median']:.1f} | {r['speedup_vs_' + baseline]:.2f}x "
            f"| {r['tokens_per_s']:.1f} | {r['tokens_per_s_ratio']:.2f}x "
            f"| {r['acc_before']:.3f} | {r['acc_after']:.3f} (n={r['n_eval']}) "
            f"| {r['acc_after_diff']:+.3f} |")
    return "\n".join(lines)
