"""One RL optimizer step of a recipe on one simulated rank, on fake tensors (mcore/fake_sim.py).

What: `simulate_rank(cfg, arch, rank=, world=)` builds the trainer's model, DDP wrapper and
optimizer from the run config with the driver's own functions (`transformer_config` with
`model_setup.megatron_kwargs`, `build_model` with `train.fused_head`, `wrap_ddp`,
`build_optimizer`), feeds a synthetic packed batch of the recipe's micro-batch and sequence
length with a top-K support of `rollout.top_logprobs` ids through the driver's step
(`schedule.optimizer_step`: megatron's forward_backward_func, our loss_func from
`loss_adapter.make_loss_func`, `finalize_model_grads`, the optimizer step), and returns a dict:
the per-category bytes of the rank (parameters, gradient buffers, optimizer main params and Adam
state, the peak of activations + temporaries during forward/backward, the loss op's own peak),
the parameter shape check (`mcore/sim_shapes.py`), the shapes the loss op received, the
stand-ins' counters and the checkpoint save plan after the step (`mcore/ckpt_plan.py`).

An FP8 recipe (`precision.fp8`) runs the same step on the local spec in the params dtype with
the stand-ins of `mcore/sim_fp8.py`: TE's shape rule checked on every FP8 GEMM operand of the
layers' linears (F1) and TE's FP8 weight copies held as their own memory category (F2); the
report's `fp8` section lists both and what they cannot show.

Not simulated: values (every number is a placeholder), kernels (the local layer spec runs, never
Transformer Engine), NCCL (collectives are no-ops of the fake process group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from megatron_pdm.arch import ModelArch
from megatron_pdm.mcore import ckpt_plan, fake_sim
from megatron_pdm.mcore import loss_adapter
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.mcore import sim_collectives, sim_devices, sim_fp8
from megatron_pdm.mcore.lm_head import lm_head_of
from megatron_pdm.mcore.model import build_model, transformer_config
from megatron_pdm.mcore.sim_shapes import check_param_shapes
from megatron_pdm.train import model_setup as ms
from megatron_pdm.train.config import RunConfig
from rollout_bridge.core.types import PackedBatch


def synthetic_batch(b: int, s: int, top_k: int, vocab_size: int) -> PackedBatch:
    """A row-aligned batch `[b, s]` (support `[b, s, K]`) of placeholder values, every row a loss
    row but the last of each sample (created inside the fake mode: no memory)."""
    loss_mask_bs = torch.ones(b, s, dtype=torch.bool)
    loss_mask_bs[:, -1] = False
    return PackedBatch(
        tokens=torch.zeros(b, s, dtype=torch.long),
        position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        labels=torch.zeros(b, s, dtype=torch.long),
        loss_mask=loss_mask_bs,
        behavior_logprob=torch.zeros(b, s, dtype=torch.float32),
        support_ids=torch.zeros(b, s, top_k, dtype=torch.int32),
        support_logprobs=torch.zeros(b, s, top_k, dtype=torch.float32),
        support_valid=torch.ones(b, s, top_k, dtype=torch.bool),
        advantages=torch.zeros(b, s, dtype=torch.float32),
        seq_ids=torch.arange(b).unsqueeze(1).expand(b, s).contiguous(),
        temperature=1.0, weight_version="0", vocab_size=vocab_size, validated=True)


def _loss_func_of(cfg: RunConfig, head, seen: dict, tracker_of, phase=contextlib.nullcontext):
    """`make_loss_func` wrapped to record the op's input shapes and its own peak; `phase()` is
    entered around it (the collective recorder's "loss" phase)."""

    def of(mb):
        inner = loss_adapter.make_loss_func(mb, cfg.loss, head=head)

        def loss_func(output_tensor):
            seen["output_tensor"] = list(output_tensor.shape)
            seen["output_dtype"] = str(output_tensor.dtype).removeprefix("torch.")
            if head is not None:
                seen["head_weight"] = list(head.weight().shape)
            with tracker_of() as pt, phase():
                out = inner(output_tensor)
            seen["loss_forward_peak_bytes"] = max(seen.get("loss_forward_peak_bytes", 0), pt.peak)
            return out

        return loss_func

    return of


def simulate_rank(cfg: RunConfig, arch: ModelArch, *, rank: int, world: int,
                  micro_batch: int, seq_length: int, microbatches: int = 1) -> dict:
    """One optimizer step of `cfg` on simulated rank `rank` of `world` (see module docstring)."""
    p = cfg.parallel
    t0 = time.time()
    report: dict = {"rank": rank, "world": world}
    with fake_sim.fake_world(rank=rank, world=world, tp=p.tp, ep=p.ep, pp=p.pp) as mode, \
            sim_devices.DeviceTagger() as tagger, sim_collectives.CollectiveRecorder() as rec:
        from megatron.core import parallel_state as ps

        rec.name_groups()
        from megatron.core.distributed import finalize_model_grads

        report["ranks"] = {"tp": ps.get_tensor_model_parallel_rank(),
                           "ep": ps.get_expert_model_parallel_rank(),
                           "pp": ps.get_pipeline_model_parallel_rank(),
                           "dp": ps.get_data_parallel_rank(),
                           "dp_size": ps.get_data_parallel_world_size()}
        first = ps.is_pipeline_first_stage(ignore_virtual=True)
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        # FP8 (stand-in F1): the local spec's linears in the params dtype; megatron's config
        # with fp8 set needs TE (its version checks, te_checkpoint under recompute)
        fp8 = cfg.precision.fp8_recipe if cfg.precision.fp8 is not None else None
        kwargs = {k: v for k, v in ms.megatron_kwargs(cfg).items()
                  if k not in ("fp8", "fp8_recipe")}
        kwargs.update(fake_sim.balanced_routing_overrides(arch))
        # the driver's config; perform_initialization off: no init values are computed.
        tconfig = transformer_config(arch, tp=p.tp, ep=p.ep, pp=p.pp,
                                     calculate_per_token_loss=True,
                                     perform_initialization=False, use_cpu_initialization=True,
                                     **kwargs)
        gpt = build_model(arch, tconfig, use_te=False, pre_process=first, post_process=last,
                          fused_head=cfg.train.fused_head)
        # on a GPU megatron builds them on the device and the trainer's place() moves the rest
        tagger.mark_device([*gpt.parameters(), *gpt.buffers()])
        report["param_shape_problems"] = check_param_shapes(gpt, arch, tp=p.tp, ep=p.ep)
        report["num_params"] = sum(t.numel() for t in gpt.parameters())
        head = lm_head_of(gpt)
        ddp = mopt.wrap_ddp(gpt, tconfig, use_distributed_optimizer=p.use_distributed_optimizer)
        tconfig.finalize_model_grads_func = finalize_model_grads
        t = cfg.train
        optimizer = mopt.build_optimizer(
            ddp, lr=t.lr, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
            use_distributed_optimizer=p.use_distributed_optimizer,
            params_dtype=cfg.precision.params_dtype, use_gloo_process_groups=False)
        report["build_s"] = round(time.time() - t0, 1)
        mbs = [synthetic_batch(micro_batch, seq_length, cfg.rollout.top_logprobs,
                               arch.require_vocab()) for _ in range(microbatches)]
        seen: dict = {}
        t1 = time.time()
        gemms = sim_fp8.Fp8GemmCheck(gpt, recipe=fp8) if fp8 else contextlib.nullcontext()
        copies_of = (sim_fp8.fp8_weight_copies(gpt, recipe=fp8) if fp8
                     else contextlib.nullcontext({"bytes": 0, "weights": 0, "tensors": []}))
        # the FP8 weight copies (F2) are allocated inside the tracker and live the whole step
        with fake_sim.PeakTracker() as step_peak, copies_of as copies, gemms:
            # the driver's step, split to read the activation peak before the optimizer runs
            from megatron_pdm.train.schedule import forward_backward

            rec.phase = "forward"
            forward_backward(ddp, optimizer, mbs,
                             _loss_func_of(cfg, head, seen, fake_sim.PeakTracker,
                                           lambda: rec.in_phase("loss")), pp=p.pp)
            fwd_bwd_peak, fwd_bwd_top = step_peak.peak, list(step_peak.peak_top)
            rec.phase = "optimizer"
            _, grad_norm, _ = optimizer.step()
            copy_bytes, n_copies = copies["bytes"], (copies["weights"], len(copies["tensors"]))
        report["step_s"] = round(time.time() - t1, 1)
        # the checkpoint Trainer.save would write after this step, planned, not written
        report["checkpoint_plan"] = ckpt_plan.plan_rank(ddp, optimizer, rank=rank)
        # the peaks without the FP8 copies (live throughout the tracked step: exact)
        report["bytes"] = dict(fake_sim.category_bytes(ddp, optimizer),
                               fp8_weight_copies=copy_bytes,
                               activations_peak=fwd_bwd_peak - copy_bytes,
                               optimizer_step_peak=step_peak.peak - copy_bytes,
                               loss_forward_peak=seen.pop("loss_forward_peak_bytes", 0))
        report["activations_peak_top"] = [
            {"bytes": n, "op": op} for n, op in fwd_bwd_top]
        report["loss_inputs"] = seen
        if fp8:
            report["fp8"] = {"format": cfg.precision.fp8, "recipe": fp8,
                             "gemm_check": gemms.report(),
                             "weight_copies": {"weights": n_copies[0], "tensors": n_copies[1],
                                               "bytes": copy_bytes},
                             "step_peak_with_weight_copies": fwd_bwd_peak,
                             "not_shown": sim_fp8.NOT_SHOWN}
        report["stand_ins"] = {"scalar_reads": mode.scalar_reads,
                               "cuda_factories_on_cpu": mode.cuda_factories}
        report["collectives"] = rec.grouped()
        report["collective_groups"] = rec.groups
        report["collective_calls"] = rec.calls
        report["device_violations"] = tagger.report()
        report["device_ops"] = tagger.device_ops
    return report


def check_loss_inputs(report: dict, arch: ModelArch, *, tp: int, micro_batch: int,
                      seq_length: int, fused_head: bool) -> list[str]:
    """The op's inputs at the recipe's shapes: vocabulary shard by the one padding rule."""
    seen = report["loss_inputs"]
    if not seen:
        return []  # not the last pipeline stage: no loss on this rank
    v_local = arch.padded_vocab(tp) // tp
    width = arch.hidden_size if fused_head else v_local
    want = [micro_batch, seq_length, width]
    problems = []
    if seen["output_tensor"] != want:
        problems.append(f"loss input {seen['output_tensor']}, expected {want}")
    if fused_head and seen.get("head_weight") != [v_local, arch.hidden_size]:
        problems.append(f"head weight {seen.get('head_weight')}, expected "
                        f"{[v_local, arch.hidden_size]}")
    return problems


def with_layers(arch: ModelArch, num_layers: int | None, num_experts: int | None) -> ModelArch:
    """`arch` with fewer layers / experts (the reduced CI size); None keeps the arch's."""
    changes = {k: v for k, v in (("num_layers", num_layers), ("num_experts", num_experts))
               if v is not None}
    return dataclasses.replace(arch, **changes)
