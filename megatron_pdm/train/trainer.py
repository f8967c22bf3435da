"""The RL loop: rollouts -> rewards -> group advantages -> PDM loss in megatron -> step -> sync.

One iteration:
1. Rollout. `LocalEngine` (over the engine copy of the policy, rollout_bridge) samples
   `group_size` answers for each of `prompts_per_iteration` prompts, with the tempered top-K
   support of every token. All ranks generate the same batch in lockstep (see rollout.py).
2. Reward (exact match) and Dr.GRPO advantages: reward minus the group mean, no std scaling.
3. `pack_padded` gives the row-aligned batch (the t-1 -> t shift happens there once).
4. `minibatches_per_iteration` optimizer steps over a fixed permutation of the samples; each
   data-parallel rank takes its slice of the minibatch, split into micro-batches, and megatron's
   `get_forward_backward_func()` runs our `loss_func` (loss/megatron_hook.py) under TP/SP/EP.
   Only the first step is on-policy w.r.t. the engine's weights; later ones are stale, which with
   the bf16 engine copy is exactly the train/rollout mismatch the trust regions control.
5. megatron-core optimizer step, then weight sync (trainer's local params -> engine copy, bf16).

Before RL the initial policy gets a short supervised warm-up on correct answers, so the starting
reward is non-zero; it is reported separately and never counted as RL progress. Greedy exact-match
accuracy on held-out prompts is measured before the warm-up, after it (= before RL) and at the end.

Checkpoints are taken at iteration boundaries, after the weight sync: model, optimizer, step
counters, the engine's sampling counters and the torch RNG; the data stream is a pure function of
(seed, iteration). So `--resume` reproduces an uninterrupted run's metrics exactly (tested).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist

from megatron_pdm.loss import megatron_hook
from megatron_pdm.megatron import checkpoint as ckpt
from megatron_pdm.megatron import optimizer as mopt
from megatron_pdm.megatron.model import build_model, transformer_config
from megatron_pdm.megatron.parallel import current_parallel_info, init_parallel
from megatron_pdm.train import model_setup as ms
from megatron_pdm.train import rollout as ro
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.logging_utils import MetricsWriter, Progress, is_rank0, log_rank0
from megatron_pdm.train.task import build_task
from rollout_bridge.packing import pack_padded
from rollout_bridge.types import PackedBatch, group_advantages

logger = logging.getLogger(__name__)


def slice_packed(batch: PackedBatch, idx: torch.Tensor) -> PackedBatch:
    """Rows `idx` of a padded PackedBatch."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    for name, value in fields.items():
        if torch.is_tensor(value) and name != "cu_seqlens":
            fields[name] = value[idx]
    return PackedBatch(**fields)


class Trainer:
    """Builds the layout, models, optimizer and engine; runs warm-up and the RL iterations."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.loss_cfg = cfg.loss_config()
        ms.check_runtime(cfg)
        p = cfg.parallel
        if p.pp > 1 and cfg.rollout.engine == "local":
            raise ValueError(
                f"parallel.pp={p.pp} needs rollout.engine=sglang: the local engine copy would "
                "run a pipeline schedule per decode step (not implemented); at scale rollouts "
                "come from SGLang")
        self.info = init_parallel(tp=p.tp, ep=p.ep, pp=p.pp, seed=cfg.seed)
        from megatron.core import parallel_state as ps

        self.dp_group = ps.get_data_parallel_group()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.task = build_task(cfg)
        self.meta = (ms.read_checkpoint_meta(cfg.checkpoint.load_dir)
                     if cfg.checkpoint.load_dir else None)
        self.arch = ms.resolve_arch(cfg, self.task.vocab_size, meta=self.meta)
        self.vocab_size = self.arch.vocab_size  # the engine's real vocabulary
        self.tconfig = transformer_config(
            self.arch, tp=p.tp, ep=p.ep, pp=p.pp, init_method_std=cfg.model.init_method_std,
            moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff, calculate_per_token_loss=True,
            **ms.megatron_kwargs(cfg))
        torch.manual_seed(cfg.seed)
        stages = dict(pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
                      post_process=self.is_last_stage, use_te=ms.use_te(cfg))
        gpt = build_model(self.arch, self.tconfig, **stages)
        if self.meta is not None:
            ms.load_initial_weights(gpt, cfg.checkpoint.load_dir, self.meta, tp=p.tp,
                                    style=ms.key_style(cfg))
        self.model = mopt.wrap_ddp(gpt, self.tconfig,
                                   use_distributed_optimizer=p.use_distributed_optimizer)
        from megatron.core.distributed import finalize_model_grads

        self.tconfig.finalize_model_grads_func = finalize_model_grads
        t = cfg.train
        self.optimizer = mopt.build_optimizer(
            self.model, lr=t.lr, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
            use_distributed_optimizer=p.use_distributed_optimizer,
            params_dtype=cfg.precision.params_dtype)
        r = cfg.rollout
        if r.engine == "sglang":
            from megatron_pdm.train.sglang_rollout import SGLangRollout

            self.rollout = SGLangRollout(cfg, self.arch, lambda: self.module, meta=self.meta,
                                         style=ms.key_style(cfg))
        else:
            rollout_gpt = build_model(self.arch, self.tconfig, use_te=ms.use_te(cfg))
            engine = ro.build_engine(
                rollout_gpt, vocab_size=self.vocab_size, top_k=r.top_k, seed=cfg.seed,
                rollout_precision=r.rollout_precision, eos_id=self.task.eos_id,
                pad_id=self.task.pad_id, tp_size=p.tp)
            self.rollout = ro.LocalRollout(engine, lambda: self.module)
        self.iteration = 0
        self.step = 0
        self.evals: dict[str, float] = {}
        self.ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")

    # ------------------------------------------------------------------ helpers

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    def sync_weights(self) -> None:
        self.rollout.sync(str(self.iteration))

    def _run_schedule(self, microbatches: list, loss_func_of) -> tuple[list[dict], float]:
        """zero grads -> megatron forward_backward over `microbatches` -> optimizer step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            # Under PP, stages after the first take the schedule's input tensor instead.
            output = model(mb.tokens if hasattr(mb, "tokens") else mb["tokens"],
                           mb.position_ids if hasattr(mb, "position_ids")
                           else mb["position_ids"], attention_mask=None)
            return output, loss_func_of(mb)

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        first = microbatches[0]
        tokens = first.tokens if hasattr(first, "tokens") else first["tokens"]
        if self.cfg.parallel.pp > 1:
            sizes = {len(m.tokens if hasattr(m, "tokens") else m["tokens"]) for m in microbatches}
            if len(sizes) != 1:
                raise ValueError(f"parallel.pp > 1 needs equal micro-batch sizes, got {sizes}: "
                                 "make samples per minibatch divisible by DP x "
                                 "microbatches_per_minibatch")
        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=[self.model],
            num_microbatches=len(microbatches), seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0], forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        return store, float(grad_norm) if grad_norm is not None else float("nan")

    def _reduce(self, store: list[dict]) -> dict[str, float]:
        """Metric means over DP, computed on the last pipeline stage and sent to every stage."""
        means = megatron_hook.reduce_metrics(store, self.dp_group) if self.is_last_stage else {}
        if self.cfg.parallel.pp == 1:
            return means
        from megatron.core import parallel_state as ps

        box = [means]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    def _generate(self, problems: list, temperature: float, n: int):
        params = {"temperature": temperature, "max_new_tokens": self.task.max_new_tokens}
        if self.cfg.rollout.engine == "sglang":
            params["stop_token_ids"] = [self.task.eos_id]
        return self.rollout.generate([self.task.prompt_ids(q) for q in problems], params, n)

    def _split(self, n: int, generator: torch.Generator, parts: int) -> list[torch.Tensor]:
        perm = torch.randperm(n, generator=generator)
        return list(perm.chunk(parts))

    def _dp_microbatches(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """This DP rank's slice of a minibatch, split into micro-batches."""
        mine = idx.chunk(self.info.dp_size)[self.info.dp_rank]
        return [m for m in mine.chunk(self.cfg.train.microbatches_per_minibatch) if len(m)]

    # ------------------------------------------------------------------ phases

    def evaluate(self, name: str) -> float:
        """Greedy exact-match accuracy of the engine copy on held-out prompts."""
        ops = self.task.eval_problems(self.cfg.seed, self.cfg.train.eval_prompts)
        if not ops:
            return float("nan")
        batch = self._generate(ops, 0.0, 1)
        acc = sum(self.task.score(q, s.response_ids.tolist())
                  for q, s in zip(ops, batch.samples)) / len(ops)
        self.evals[name] = acc
        log_rank0("eval %s: greedy exact-match accuracy %.3f", name, acc)
        return acc

    def warmup(self) -> None:
        """Supervised warm-up on correct answers (not RL; reported separately)."""
        w = self.cfg.warmup
        if w.steps <= 0:
            return
        if not getattr(self.task, "supports_sft", False):
            raise ValueError(f"warmup.steps={w.steps}: task {self.cfg.task.name} has no "
                             "supervised warm-up; set warmup.steps=0")
        mopt.set_lr(self.optimizer, w.lr)
        tp = self.cfg.parallel.tp
        vocab = self.vocab_size
        t0 = time.time()
        loss = float("nan")
        for i in range(w.steps):
            ops = self.task.operands_for(self.cfg.seed + 1, i, w.batch_size)
            full = self.task.sft_batch(ops)
            length = full["tokens"].shape[1]
            padded = -(-length // tp) * tp
            for key in full:
                pad_value = False if key == "loss_mask" else self.task.pad_id
                extra = torch.full((w.batch_size, padded - length), pad_value,
                                   dtype=full[key].dtype)
                full[key] = torch.cat([full[key], extra], dim=1)
            full["position_ids"] = torch.arange(padded).expand(w.batch_size, padded)
            idx = torch.arange(w.batch_size)
            mbs = [{k: v[m] for k, v in full.items()} for m in self._dp_microbatches(idx)]
            store, _ = self._run_schedule(
                mbs, lambda mb: (lambda out: sft_loss_func(out, mb, vocab)))
            loss = self._reduce(store)["sft/loss"]
        log_rank0("warm-up: %d supervised steps, final CE %.4f, %.1f s", w.steps, loss,
                  time.time() - t0)
        mopt.set_lr(self.optimizer, self.cfg.train.lr)

    def rl_iteration(self, writer: MetricsWriter) -> dict:
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.time()
        ops = self.task.problems(cfg.seed, self.iteration, r.prompts_per_iteration)
        batch = self._generate(ops, r.temperature, r.group_size)
        rewards = [self.task.score(ops[s.group_index], s.response_ids.tolist())
                   for s in batch.samples]
        batch.set_rewards(rewards)
        adv_b = group_advantages(batch)
        packed = pack_padded(batch, adv_b, pad_id=self.task.pad_id,
                             pad_to_multiple_of=cfg.parallel.tp)
        t_rollout = time.time() - t0
        reward_mean = sum(rewards) / len(rewards)
        g = torch.Generator().manual_seed(cfg.seed * 31 + self.iteration)
        minibatches = self._split(len(batch.samples), g, cfg.train.minibatches_per_iteration)
        last = {}
        for j, idx in enumerate(minibatches):
            t1 = time.time()
            mbs = [slice_packed(packed, m) for m in self._dp_microbatches(idx)]
            store, grad_norm = self._run_schedule(
                mbs, lambda mb: megatron_hook.make_loss_func(
                    mb, self.loss_cfg, vocab_size=self.vocab_size,
                    temperature=packed.temperature))
            means = self._reduce(store)
            self.step += 1
            row = {"step": self.step, "iteration": self.iteration, "minibatch": j,
                   "reward/mean": reward_mean,
                   "reward/frac_solved_groups": _frac_solved(rewards, r.group_size),
                   "rollout/response_len": float(packed.loss_mask.sum()) / len(batch.samples),
                   "lr": self.cfg.train.lr, "grad_norm": grad_norm, **means,
                   "rollout/weight_version": float(batch.weight_version)
                   if str(batch.weight_version).isdigit() else float("nan"),
                   "time/rollout_s": t_rollout if j == 0 else 0.0,
                   "time/train_step_s": time.time() - t1}
            writer.write(row)
            last = row
        self.iteration += 1
        t2 = time.time()
        self.sync_weights()
        last["time/weight_sync_s"] = time.time() - t2
        return last

    # ------------------------------------------------------------------ state

    def train_state(self) -> dict:
        return {"iteration": self.iteration, "step": self.step, "evals": dict(self.evals),
                "engine": self.rollout.state_dict(), "torch_rng": torch.get_rng_state()}

    def load_train_state(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        self.step = int(state["step"])
        self.evals = dict(state["evals"])
        self.rollout.load_state_dict(state["engine"])
        torch.set_rng_state(state["torch_rng"])

    def save(self) -> None:
        ckpt.save_checkpoint(self.ckpt_dir, self.iteration, self.model, self.optimizer,
                             self.train_state(), keep_last=self.cfg.checkpoint.keep_last)

    # ------------------------------------------------------------------ main

    def run(self, *, resume: bool) -> dict:
        cfg = self.cfg
        start = time.time()
        path = ckpt.latest_checkpoint(self.ckpt_dir) if resume else None
        if path is not None:
            self.load_train_state(ckpt.load_checkpoint(path, self.model, self.optimizer))
            mopt.set_lr(self.optimizer, cfg.train.lr)
            self.sync_weights()
            log_rank0("resumed from %s at iteration %d (step %d)", path, self.iteration,
                      self.step)
        elif cfg.rollout.engine == "sglang" and cfg.warmup.steps <= 0:
            if cfg.rollout.sync_at_start:
                self.sync_weights()  # servers start from exactly the trainer's weights
            self.evaluate("before_rl")
            if cfg.checkpoint.save_interval > 0:
                self.save()
        else:
            self.sync_weights()
            self.evaluate("before_warmup")
            self.warmup()
            self.sync_weights()
            self.evaluate("before_rl")
            if cfg.checkpoint.save_interval > 0:
                self.save()
        writer = MetricsWriter(cfg.output_dir, resume_step=self.step if path else None,
                               tensorboard=cfg.log.tensorboard)
        progress = Progress(cfg.train.iterations, self.iteration, cfg.log.progress)
        done_here = 0
        interrupted = False
        while self.iteration < cfg.train.iterations:
            stop = cfg.checkpoint.stop_after_iterations
            if stop is not None and done_here >= stop:
                interrupted = True  # simulated crash: exit without saving
                break
            row = self.rl_iteration(writer)
            done_here += 1
            progress.update(row["reward/mean"], row.get("pdm/masked_frac", float("nan")),
                            row.get("mismatch/abs_logprob_diff", float("nan")))
            every = cfg.checkpoint.save_interval
            if every > 0 and self.iteration % every == 0 and self.iteration < cfg.train.iterations:
                self.save()
        progress.close()
        writer.close()
        if interrupted:
            log_rank0("stopped after %d iterations (checkpoint.stop_after_iterations)", done_here)
            return {"interrupted": True}
        self.evaluate("after_rl")
        self.save()
        return {"interrupted": False, "wall_s": time.time() - start}


def _frac_solved(rewards: list[float], group: int) -> float:
    groups = [rewards[i:i + group] for i in range(0, len(rewards), group)]
    return sum(1.0 for g in groups if max(g) > 0) / max(len(groups), 1)


def sft_loss_func(logits_bsv: torch.Tensor, mb: dict, vocab_size: int):
    """Cross-entropy on answer rows; Megatron's padded vocab ids are pushed out of the softmax."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    vl = logits_bsv.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vl
    pad_cols = (torch.arange(start, start + vl) >= vocab_size)
    logits_bsv = logits_bsv.masked_fill(pad_cols, -1e4)
    # megatron's op takes [s, b, Vl] logits and [s, b] targets.
    ce_sb = vocab_parallel_cross_entropy(logits_bsv.transpose(0, 1).contiguous(),
                                         mb["labels"].transpose(0, 1).contiguous())
    mask_sb = mb["loss_mask"].transpose(0, 1)
    loss_sum = (ce_sb * mask_sb).sum()
    n = mask_sb.sum()
    metric = torch.stack([loss_sum.detach().double(), n.double()])
    return loss_sum, n.to(torch.int), {"sft/loss": metric}


def run_main(cfg: RunConfig, *, resume: bool) -> dict:
    """Entry point used by __main__ (torchrun) and the tests."""
    trainer = Trainer(cfg)
    log_rank0("resolved config: %s", cfg.to_dict())
    log_rank0("parallel layout: %s", current_parallel_info())
    result = trainer.run(resume=resume)
    if not result["interrupted"] and is_rank0():
        from megatron_pdm.train import report

        result.update(report.finish(cfg, trainer.evals, result["wall_s"]))
    dist.barrier()
    return result
