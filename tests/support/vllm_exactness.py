"""torchrun worker of the on-policy exactness check (tests/train/rollout/test_vllm_exactness.py).

Builds the driver's `Trainer` (rollout.engine=vllm, fp32 weights, fp32 server), pushes the live
sharded weights to vLLM (`VLLMGlue.push`: gather -> safetensors -> /collective_rpc), draws a
batch there, and scores the same sequences with the Megatron model at this TP: per loss token,
|log pi(sampled) - engine logprob| and, over every valid top-K support slot,
|log pi(id) - engine logprob(id)|, with log pi = log_softmax(logits / T) over the engine's
vocabulary. Then 3 optimizer steps change every weight, the new weights are pushed, and the
check repeats (a reload of changed weights, MoE repack included). Rank 0 writes a JSON report.

Usage: torchrun --nproc-per-node 2 tests/support/vllm_exactness.py OUT.json --set k=v ...
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist


def compare(trainer, temperature: float, label: str) -> dict:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_pdm.mcore.loss_adapter import to_bsv
    from megatron_pdm.train.logprob_check import LogprobAgreement
    from rollout_bridge.core.packing import pack_padded

    cfg = trainer.cfg
    problems = trainer.task.problems(cfg.seed, 0, cfg.rollout.prompts_per_iteration)
    t0 = time.time()
    batch = trainer._generate(problems, temperature, cfg.rollout.group_size)
    gen_s = time.time() - t0
    adv = torch.zeros(len(batch.samples))
    packed = pack_padded(batch, adv, pad_id=trainer.task.pad_id,
                         pad_to_multiple_of=cfg.parallel.tp)
    b, s = packed.tokens.shape
    with torch.no_grad():
        out = trainer.module(packed.tokens, packed.position_ids, attention_mask=None)
        logits = gather_from_tensor_model_parallel_region(to_bsv(out, b, s).contiguous())
    check = LogprobAgreement(batch.top_logprobs, batch.vocab_size, temperature)
    check.add(logits, packed)
    return {"label": label, "weight_version": batch.weight_version,
            "samples": len(batch.samples), "failures": len(batch.failures),
            **check.report(), "generate_s": gen_s}


def main() -> None:
    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.trainer import Trainer

    out_path = sys.argv[1]
    overrides = [a for flag, a in zip(sys.argv[2:], sys.argv[3:]) if flag == "--set"]
    cfg = RunConfig.load(sys.argv[sys.argv.index("--config") + 1], overrides)
    trainer = Trainer(cfg)
    report = {"tp": cfg.parallel.tp, "ep": cfg.parallel.ep, "checks": []}
    t0 = time.time()
    trainer.sync_weights()  # version "0": the trainer's initial weights replace the served ones
    report["push_s"] = [time.time() - t0]
    report["push"] = [trainer.rollout.last_push]
    for temperature in (1.0, 0.7):
        report["checks"].append(compare(trainer, temperature, "initial weights"))
    trainer.warmup()  # warmup.steps optimizer steps: every weight changes
    trainer.iteration = 1
    t0 = time.time()
    trainer.sync_weights()
    report["push_s"].append(time.time() - t0)
    report["push"].append(trainer.rollout.last_push)
    for temperature in (1.0, 0.7):
        report["checks"].append(compare(trainer, temperature, "after optimizer steps"))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
    dist.barrier()


if __name__ == "__main__":
    main()
