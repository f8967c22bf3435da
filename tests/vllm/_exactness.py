"""torchrun worker of the on-policy exactness check (tests/vllm/test_2_exactness.py).

Builds the driver's `Trainer` (rollout.engine=vllm, fp32 weights, fp32 server), pushes the live
sharded weights to vLLM (`VLLMRollout._push`: gather -> safetensors -> /collective_rpc), draws a
batch there, and scores the same sequences with the Megatron model at this TP: per loss token,
|log pi(sampled) - engine logprob| and, over every valid top-K support slot,
|log pi(id) - engine logprob(id)|, with log pi = log_softmax(logits / T) over the engine's
vocabulary. Then 3 optimizer steps change every weight, the new weights are pushed, and the
check repeats (a reload of changed weights, MoE repack included). Rank 0 writes a JSON report.

Usage: torchrun --nproc-per-node 2 tests/vllm/_exactness.py OUT.json --set k=v ...
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
    vocab = batch.vocab_size
    lp_bsv = torch.log_softmax(logits[..., :vocab].double() / temperature, dim=-1)
    mask = packed.loss_mask
    sampled = lp_bsv.gather(-1, packed.labels.clamp(max=vocab - 1)[..., None])[..., 0]
    err_sampled = (sampled - packed.behavior_logprob.double())[mask].abs()
    valid = packed.support_valid & mask[..., None]
    ids = packed.support_ids.long().clamp(max=vocab - 1)
    at_support = lp_bsv.gather(-1, ids)
    err_support = (at_support - packed.support_logprobs.double())[valid].abs()
    # top-K ids the trainer would pick vs the engine's (slots 0..K-1 that are valid)
    k = batch.top_logprobs
    top_trainer = torch.topk(lp_bsv, k, dim=-1).indices.sort(-1).values
    eng = packed.support_ids[..., :k].long()
    eng_valid = packed.support_valid[..., :k]
    full_rows = mask & eng_valid.all(-1)
    same_set = (top_trainer == eng.sort(-1).values).all(-1)[full_rows]
    return {"label": label, "temperature": temperature, "weight_version": batch.weight_version,
            "samples": len(batch.samples), "failures": len(batch.failures),
            "tokens": int(mask.sum()), "support_slots": int(valid.sum()),
            "max_abs_err_sampled": float(err_sampled.max()),
            "mean_abs_err_sampled": float(err_sampled.mean()),
            "max_abs_err_support": float(err_support.max()),
            "mean_abs_err_support": float(err_support.mean()),
            "topk_set_agreement": float(same_set.double().mean()),
            "generate_s": gen_s}


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
