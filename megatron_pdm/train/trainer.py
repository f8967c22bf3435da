"""The RL loop: rollouts -> rewards -> group advantages -> PDM loss in megatron -> step -> sync.

One iteration:
1. Rollout. The rollout source (train/rollout/: `LocalEngine` over an engine copy of the policy
   on every rank, or SGLang / vLLM servers driven by rank 0) samples `group_size` answers for
   each of `prompts_per_iteration` prompts, with the tempered top-K support of every token.
2. Reward and Dr.GRPO advantages: reward minus the group mean, no std scaling.
3. `pack_padded` gives the row-aligned batch (the t-1 -> t shift happens there once); the batch
   carries the rollout's temperature, vocabulary and validation state to the loss.
4. `epochs_per_batch` passes, each `minibatches_per_iteration` optimizer steps over a fresh
   permutation of the samples (epoch 0's is the same as before epochs existed); each
   data-parallel rank takes its slice of the minibatch, split into micro-batches, and megatron's
   schedule runs our `loss_func` (mcore/loss_adapter.py) under TP/SP/EP/PP (schedule.py).
   Only the first step is on-policy w.r.t. the engine's weights; later ones are stale, which with
   a bf16/FP8 engine is exactly the train/rollout mismatch the trust regions control.
5. Weight sync (trainer -> engine), versioned by the iteration number.

Overlap (`rollout.overlap`, server engines only; train/rollout/feed.py): iteration i+1's batch
is generated while iteration i trains and collected before the weight sync, so from the second
iteration on every batch is one version stale; a checkpoint holds the collected, not yet trained
batch (`train_state["overlap_batch"]`).

Start-up (`_prepare`, once per fresh run): push the initial weights, evaluate, run the optional
supervised warm-up (warmup.py; reported separately, never counted as RL progress), push again,
evaluate, save the iteration-0 checkpoint. `--resume` replaces all of it by a checkpoint load.

Checkpoints are taken at iteration boundaries, after the weight sync: model, optimizer, step
counters, the engine's sampling counters and the torch RNG; the data stream is a pure function of
(seed, iteration). So a run killed at any point and resumed with `--resume` reproduces the
uninterrupted run's metrics exactly (tested by killing the process).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from statistics import fmean

import torch
import torch.distributed as dist

from megatron_pdm import metrics as M
from megatron_pdm.mcore import checkpoint as ckpt
from megatron_pdm.mcore import ckpt_files
from megatron_pdm.mcore import loss_adapter
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.mcore.lm_head import lm_head_of
from megatron_pdm.mcore.device import place
from megatron_pdm.mcore.model import build_model, transformer_config
from megatron_pdm.mcore.parallel import current_parallel_info, init_parallel
from megatron_pdm.train import evaluation as ev
from megatron_pdm.train import model_setup as ms
from megatron_pdm.train import resume as resume_rules
from megatron_pdm.train import warmup as wu
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.logging_utils import (
    MetricsWriter,
    Progress,
    is_rank0,
    log_rank0,
    wandb_init_kwargs,
)
from megatron_pdm.train.rollout import store as rollout_store
from megatron_pdm.train.rollout.factory import build_rollout
from megatron_pdm.train.rollout.feed import RolloutFeed
from megatron_pdm.train.rollout.local import latest_weights
from megatron_pdm.train import schedule as sched
from megatron_pdm.train.schedule import optimizer_step, reduce_step_metrics, rl_lr
from megatron_pdm.train.task import build_task
from rollout_bridge.core.packing import pack_padded
from rollout_bridge.core.types import frac_solved_groups, group_advantages, sampled_entropy

logger = logging.getLogger(__name__)


class Trainer:
    """Builds the layout, models, optimizer and rollout source; runs warm-up and RL."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        ms.check_runtime(cfg)
        p = cfg.parallel
        self.info = init_parallel(tp=p.tp, ep=p.ep, pp=p.pp, seed=cfg.seed)
        from megatron.core import parallel_state as ps

        self.dp_group = ps.get_data_parallel_group()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.task = build_task(cfg)
        self.meta = (ms.read_checkpoint_meta(cfg.checkpoint.load_dir)
                     if cfg.checkpoint.load_dir else None)
        self.arch = ms.resolve_arch(cfg, self.task.vocab_size, meta=self.meta)
        self.tconfig = transformer_config(self.arch, tp=p.tp, ep=p.ep, pp=p.pp,
                                          calculate_per_token_loss=True,
                                          **ms.megatron_kwargs(cfg))
        torch.manual_seed(cfg.seed)
        gpt = place(build_model(self.arch, self.tconfig, use_te=ms.use_te(cfg),
                                pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
                                post_process=self.is_last_stage, fused_head=cfg.train.fused_head))
        # train.fused_head: the losses apply the LM head themselves (None: the model's logits).
        self.head = lm_head_of(gpt)
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
        self.rollout = build_rollout(cfg, self.arch, self.tconfig, self.task,
                                     lambda: self.module, meta=self.meta)
        # the iteration's batches (rollout.overlap: one generated ahead) and the evaluations'
        self.feed = RolloutFeed(self.rollout, self.task, cfg)
        self.iteration = 0
        self.step = 0
        self.evals: dict[str, float] = {}
        self.writer: MetricsWriter | None = None  # set by run(): TensorBoard / W&B scalars
        self.ckpt_dir = resume_rules.checkpoint_dir(cfg)
        self.run_id = resume_rules.new_run_id() if dist.get_rank() == 0 else ""

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    # ------------------------------------------------------------------ building blocks

    def sync_weights(self) -> None:
        """Pushes the trainer's weights to the rollout engine as version `iteration`."""
        self.rollout.sync(str(self.iteration))

    def _step(self, microbatches: list, loss_func_of) -> tuple[dict[str, float], float]:
        """One optimizer step over this rank's micro-batches; metric means over DP (and the
        step's phase times, `time/fwd_bwd_s` and `time/optimizer_s`, this rank's)."""
        timings: dict[str, float] = {}
        store, grad_norm = optimizer_step(self.model, self.optimizer, microbatches,
                                          loss_func_of, pp=self.cfg.parallel.pp, timings=timings)
        means = reduce_step_metrics(store, dp_group=self.dp_group,
                                    is_last_stage=self.is_last_stage, pp=self.cfg.parallel.pp)
        means[M.TIME_FWD_BWD] = timings["fwd_bwd_s"]
        means[M.TIME_OPTIMIZER] = timings["optimizer_s"]
        return means, grad_norm

    def _generate(self, problems: list, temperature: float, n: int):
        """Collective: `n` samples per problem from the engine now (evaluations, warm-up probes)."""
        return self.feed.generate(problems, temperature, n)

    def _dp_microbatches(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """This DP rank's slice of a minibatch, split into micro-batches."""
        return sched.dp_microbatches(idx, dp_size=self.info.dp_size, dp_rank=self.info.dp_rank,
                                     microbatches=self.cfg.train.microbatches_per_minibatch)

    # ------------------------------------------------------------------ phases

    def _greedy_accuracy(self, problems: list) -> float:
        with latest_weights(self.rollout):  # rollout.local.staleness: evaluate the newest policy
            batch = self._generate(problems, 0.0, 1)
        return fmean(ev.score_samples(self.task, problems, batch, 1))

    def evaluate(self, name: str) -> float:
        """Held-out evaluation through the engine (megatron_pdm/train/evaluation.py, `run_heldout`);
        rank 0 appends the per-problem record to eval.jsonl. Collective."""
        t = self.cfg.train
        problems = self.task.eval_problems(self.cfg.seed, t.eval_prompts)
        if not problems:
            return float("nan")
        with latest_weights(self.rollout):  # rollout.local.staleness: the newest policy
            rec, greedy = ev.run_heldout(name, self.iteration, self.task, problems, self._generate,
                                         aside=self.feed.aside, eval_samples=t.eval_samples,
                                         temperature=self.cfg.rollout.temperature)
        if t.eval_crosscheck:
            sub = [s for s in greedy.samples if s.group_index < t.eval_crosscheck]
            rec.crosscheck = ev.crosscheck(
                self.module, dataclasses.replace(greedy, samples=sub), pad_id=self.task.pad_id,
                pad_to_multiple_of=ms.seq_multiple(self.cfg), tp=self.cfg.parallel.tp)
        acc = self.evals[name] = rec.greedy_acc
        if is_rank0():
            ev.append_record(self.cfg.output_dir, rec)
        log_rank0("eval %s: %s", name, ev.describe(rec))
        if self.writer is not None:
            self.writer.scalar(f"eval/greedy_acc_{name}", acc, self.step)
            if rec.sampled:
                self.writer.scalar(f"eval/sampled_acc_{name}", fmean(rec.sampled), self.step)
        return acc

    def warmup(self) -> None:
        """Supervised warm-up on correct answers (not RL; reported separately)."""
        w = self.cfg.warmup
        if not getattr(self.task, "supports_sft", False):
            raise ValueError(f"warmup.steps={w.steps}: task {self.cfg.task.name} has no "
                             "supervised warm-up; set warmup.steps=0")
        mopt.set_lr(self.optimizer, w.lr)
        vocab = self.arch.vocab_size
        rule = wu.StopRule(w.stop_at_accuracy, w.check_every)
        probe = (self.task.probe_problems(self.cfg.seed, w.probe_prompts)
                 if w.stop_at_accuracy is not None else [])
        t0, loss, done = time.time(), float("nan"), 0
        for i in range(w.steps):
            problems = self.task.operands_for(self.cfg.seed + 1, i, w.batch_size)
            batch = wu.sft_batch(self.task, problems, pad_id=self.task.pad_id,
                                 pad_to_multiple_of=ms.seq_multiple(self.cfg))
            mbs = [batch.select_rows(m) for m in self._dp_microbatches(torch.arange(w.batch_size))]
            means, _ = self._step(mbs, lambda mb: (
                lambda out: wu.sft_loss_func(out, mb, vocab, head=self.head)))
            loss, done = means[M.SFT_LOSS], i + 1
            if rule.due(done):
                self.sync_weights()
                reached = rule.reached(done, self._greedy_accuracy(probe))
                if self.writer is not None:
                    self.writer.scalar("warmup/probe_acc", rule.probes[-1][1], done)
                    self.writer.scalar("warmup/sft_loss", loss, done)
                if reached:
                    break
        self.evals["warmup_steps"] = float(done)
        if rule.probes:
            self.evals["warmup_probe_acc"] = rule.probes[-1][1]
            if rule.probes[-1][1] < rule.target:
                log_rank0("warm-up: the probe accuracy did not reach warmup.stop_at_accuracy=%s "
                          "in warmup.steps=%d steps", rule.target, w.steps, level=logging.WARNING)
        log_rank0("warm-up: %d supervised steps, final CE %.4f, %.1f s", done, loss,
                  time.time() - t0)
        wu.drop_optimizer_state(self.optimizer)  # RL's lr is set before every step (rl_lr)

    def rl_iteration(self, writer: MetricsWriter) -> dict:
        """Rollout, advantages, `minibatches_per_iteration` optimizer steps, weight sync."""
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.time()
        problems, batch = self.feed.iteration_batch(self.iteration)
        rewards = [self.task.score(problems[s.group_index], s.response_ids.tolist())
                   for s in batch.samples]
        batch.set_rewards(rewards)
        rollout_store.save_rollout(cfg, self.iteration, batch)  # log.save_rollouts (opt-in)
        packed = pack_padded(batch, group_advantages(batch), pad_id=self.task.pad_id,
                             pad_to_multiple_of=ms.seq_multiple(cfg))
        t_rollout = time.time() - t0
        plan = [(e, j, idx) for e in range(cfg.train.epochs_per_batch)
                for j, idx in enumerate(sched.minibatch_plan(
                    cfg.seed, self.iteration, len(batch.samples),
                    cfg.train.minibatches_per_iteration, epoch=e))]
        entropy = sampled_entropy(batch)
        version = (float(batch.weight_version) if str(batch.weight_version).isdigit()
                   else float("nan"))
        staleness = self.iteration - version  # trainer weights = version str(self.iteration)
        t_rollout += self.feed.ready_wait_s
        pad_frac = 1.0 - float(sum(len(smp.prompt_ids) + len(smp.response_ids)
                                   for smp in batch.samples)) / max(packed.tokens.numel(), 1)
        last: dict = {}
        steps_this_batch = 0
        for e, j, idx in plan:
            if last:  # the iteration's last row waits for the push's time (below)
                writer.write(last)
            t1 = time.time()
            mbs = [packed.select_rows(m) for m in self._dp_microbatches(idx)]
            lr = rl_lr(cfg.train, self.step)  # from the step count: a resume continues it
            mopt.set_lr(self.optimizer, lr)
            means, grad_norm = self._step(
                mbs, lambda mb: loss_adapter.make_loss_func(mb, cfg.loss, head=self.head))
            self.step += 1
            steps_this_batch += 1
            last = {M.STEP: self.step, M.ITERATION: self.iteration, M.MINIBATCH: j,
                    M.EPOCH: e, M.STEPS_THIS_BATCH: steps_this_batch, M.ENTROPY_SAMPLED: entropy,
                    M.REWARD_MEAN: sum(rewards) / len(rewards),
                    M.REWARD_FRAC_SOLVED_GROUPS: frac_solved_groups(rewards, r.group_size),
                    M.RESPONSE_LEN: float(packed.loss_mask.sum()) / len(batch.samples),
                    M.LR: lr, M.GRAD_NORM: grad_norm, **means,
                    M.WEIGHT_VERSION: version, M.STALENESS: staleness,
                    M.TIME_ROLLOUT: t_rollout if steps_this_batch == 1 else 0.0,
                    M.TIME_TRAIN_STEP: time.time() - t1, M.NUM_SAMPLES: len(batch.samples),
                    M.PAD_FRAC: pad_frac, M.TIME_WEIGHT_SYNC: 0.0, M.TIME_ITERATION: 0.0,
                    M.TIME_UNIX: time.time()}
        self.iteration += 1
        # The last row waits for the push's time; a push (or overlapped rollout) that fails still
        # writes it, with the two times unknown (null): its optimizer step happened, and a log
        # missing it would read as a partly trained batch.
        last[M.TIME_WEIGHT_SYNC] = last[M.TIME_ITERATION] = float("nan")
        try:
            self.feed.collect_next()  # overlap: the server must be idle before the push
            t2 = time.time()
            self.sync_weights()
            last[M.TIME_WEIGHT_SYNC] = time.time() - t2
            last[M.TIME_ITERATION] = time.time() - t0
        finally:
            writer.write(last)
        return last

    # ------------------------------------------------------------------ state

    def train_state(self) -> dict:
        return {"iteration": self.iteration, "step": self.step, "evals": dict(self.evals),
                "engine": self.rollout.state_dict(), "torch_rng": torch.get_rng_state(),
                "overlap_batch": self.feed.state()}

    def load_train_state(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        self.step = int(state["step"])
        self.evals = dict(state["evals"])
        self.rollout.load_state_dict(state["engine"])
        torch.set_rng_state(state["torch_rng"])
        self.feed.load_state(state.get("overlap_batch"))

    def save(self) -> None:
        ckpt.save_checkpoint(self.ckpt_dir, self.iteration, self.model, self.optimizer,
                             self.train_state(), keep_last=self.cfg.checkpoint.keep_last,
                             run_id=self.run_id,
                             identity=resume_rules.identity(self.cfg, dist.get_world_size()),
                             hook=resume_rules.save_hook(self.iteration))  # tests only

    def _restore(self) -> bool:
        """Loads the newest complete checkpoint of output_dir (verified, resume.py's rules);
        False when the directory holds none."""
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            log_rank0("--resume: no checkpoint in %s, starting fresh", self.ckpt_dir)
            return False
        self.run_id = ckpt_files.read_manifest(path)["run_id"]  # rotation continues this run's
        self.load_train_state(ckpt.load_checkpoint(path, self.model, self.optimizer))
        self.sync_weights()
        log_rank0("resumed from %s at iteration %d (step %d)", path, self.iteration, self.step)
        return True

    def _prepare(self) -> None:
        """Fresh start: initial push, evaluations around the optional warm-up, first save."""
        r = self.cfg.rollout
        # A server may already hold the initial weights (rollout.sync_at_start=false); the local
        # engine copy always needs them.
        if r.engine == "local" or r.sync_at_start:
            self.sync_weights()
        if self.cfg.warmup.steps > 0:
            self.evaluate("before_warmup")
            self.warmup()
            self.sync_weights()
        self.evaluate("before_rl")
        if self.cfg.checkpoint.save_interval > 0:
            self.save()

    # ------------------------------------------------------------------ main

    def run(self, *, resume: bool) -> dict:
        cfg = self.cfg
        start = time.time()
        resumed = self._restore() if resume else False
        writer = self.writer = MetricsWriter(
            cfg.output_dir, resume_step=self.step if resumed else None,
            tensorboard=cfg.log.tensorboard, wandb=wandb_init_kwargs(cfg))
        if not resumed:
            self._prepare()
        progress = Progress(cfg.train.iterations, self.iteration, cfg.log.progress)
        every = cfg.checkpoint.save_interval
        while self.iteration < cfg.train.iterations:
            row = self.rl_iteration(writer)
            progress.update(row[M.REWARD_MEAN], row.get(M.MASKED_FRAC, float("nan")),
                            row.get(M.ABS_LOGPROB_DIFF, float("nan")))
            k = cfg.train.eval_interval
            if k > 0 and self.iteration % k == 0 and self.iteration < cfg.train.iterations:
                  with self.feed.aside():  # the run's next rollouts as without this evaluation
                    self.evaluate(f"rl_iter{self.iteration}")  # the last: "after_rl" below
            if every > 0 and self.iteration % every == 0 and self.iteration < cfg.train.iterations:
                self.save()
        progress.close()
        self.evaluate("after_rl")
        writer.close()
        self.save()
        return {"wall_s": time.time() - start}


def run_main(cfg: RunConfig, *, resume: bool) -> dict:
    """Entry point used by __main__ (torchrun) and the tests."""
    trainer = Trainer(cfg)
    from megatron_pdm.mcore import fallback_summary

    if fallback_summary():
        log_rank0(fallback_summary())
    log_rank0("resolved config: %s", cfg.to_dict())
    if is_rank0():
        os.makedirs(cfg.output_dir, exist_ok=True)
        moved = None if resume else resume_rules.move_aside(cfg)  # allow_fresh_start=true
        if moved:
            log_rank0("fresh start: the previous run was moved to %s", moved)
        cfg.save(os.path.join(cfg.output_dir, "config.yaml"))  # loads back with --config
    log_rank0("parallel layout: %s", current_parallel_info())
    result = trainer.run(resume=resume)
    if is_rank0():
        from megatron_pdm.train import report

        result.update(report.finish(cfg, trainer.evals, result["wall_s"]))
    dist.barrier()
    return result
