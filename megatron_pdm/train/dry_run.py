"""`--dry-run`: validate the run's parallel layout and print a per-GPU memory estimate.

Never initialises torch.distributed and never builds the model: it only reads the config and
calls megatron_pdm.layout (`validate_layout`, `estimate_memory`, `format_report`). The world size
is torchrun's WORLD_SIZE when set, else the smallest world for the layout
(`megatron_pdm.arch.min_world_size`).

Architecture: the checkpoint's `pdm_model.json` when `checkpoint.load_dir` exists on this machine
(checked against the model section like a real run), else the model section; the vocabulary is
`model.vocab_size`, else the task's (the jsonl tokenizer is only read if its directory exists).
Sequence length: `rollout.max_sequence_length`, else the task's prompt + answer length.
"""

from __future__ import annotations

import logging
import os

from megatron_pdm.arch import min_world_size
from megatron_pdm.configtree import ConfigError
from megatron_pdm.convert.load_dir import meta_dir
from megatron_pdm.train.config import RunConfig

logger = logging.getLogger(__name__)


def _task_vocab_and_seq(cfg: RunConfig) -> tuple[int | None, int | None]:
    if cfg.task.name == "addition":
        from megatron_pdm.train.task import AdditionTask, Tokenizer

        task = AdditionTask(cfg.task.num_digits,
                            Tokenizer(num_filler_tokens=cfg.task.num_filler_tokens))
        return task.vocab_size, task.prompt_len + task.answer_len
    if cfg.task.tokenizer_dir and os.path.isdir(cfg.task.tokenizer_dir):
        from megatron_pdm.train.jsonl_task import load_tokenizer

        return len(load_tokenizer(cfg.task.tokenizer_dir)), None
    return None, None


def micro_batch_size(cfg: RunConfig, dp: int) -> int:
    """Samples per micro-batch on one DP rank (what the trainer's split gives, at least 1)."""
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    return max(1, samples // (cfg.train.minibatches_per_iteration * dp
                              * cfg.train.microbatches_per_minibatch))


def dry_run(cfg: RunConfig) -> int:
    """Prints the layout report (rank 0 / single process). Returns a process exit code."""
    from megatron_pdm import layout
    from megatron_pdm.train import model_setup as ms

    p = cfg.parallel
    rank0 = int(os.environ.get("RANK", "0")) == 0
    task_vocab, task_seq = _task_vocab_and_seq(cfg)
    meta = None
    load_dir = cfg.checkpoint.load_dir
    if load_dir and (meta_dir(load_dir) / "pdm_model.json").exists():
        meta = ms.read_checkpoint_meta(load_dir)
    elif load_dir and rank0:
        print(f"dry run: {load_dir}/pdm_model.json not found here; using the model section",
              flush=True)
    if task_vocab is None and cfg.model.vocab_size is None and meta is None:
        print("dry run: set model.vocab_size (the tokenizer directory is not available here)",
              flush=True)
        return 2
    try:
        arch = ms.resolve_arch(cfg, task_vocab or 0, meta=meta)
    except ValueError as err:
        if rank0:
            print(f"dry run: {err}", flush=True)
        return 2
    world = int(os.environ.get("WORLD_SIZE", min_world_size(tp=p.tp, pp=p.pp, ep=p.ep)))
    try:
        lay = layout.validate_layout(arch, world_size=world, tp=p.tp, pp=p.pp, ep=p.ep, etp=1)
    except ConfigError as err:
        if rank0:
            print(f"dry run: invalid layout\n{err}", flush=True)
        return 2
    seq = cfg.rollout.max_sequence_length or task_seq or arch.max_position_embeddings
    micro = micro_batch_size(cfg, lay.dp)
    te = ms.use_te(cfg)  # the layer spec this machine would build (fused attention with TE)

    def estimate(attention: str):
        return layout.estimate_memory(arch, lay, micro_batch_size=micro, seq_length=seq,
                                      params_dtype=cfg.precision.params_dtype,
                                      fp8=cfg.precision.fp8 is not None,
                                      distributed_optimizer=p.use_distributed_optimizer,
                                      recompute=cfg.train.recompute,
                                      num_microbatches=cfg.train.microbatches_per_minibatch,
                                      attention=attention,
                                      fused_head_chunk=_fused_head_chunk(cfg))

    est = estimate("fused" if te else "local")
    if rank0:
        print(layout.format_report(arch, lay, est), flush=True)
        if te:
            print("  layer spec: transformer-engine (fused attention, no s x s scores)", flush=True)
        else:
            print("  layer spec: local (transformer-engine is not importable here); with it "
                  f"(fused attention) the total is {estimate('fused').total / layout.GIB:.2f} GiB",
                  flush=True)
        print(f"  micro-batch: {micro} x {seq} tokens ({cfg.rollout.prompts_per_iteration} "
              f"prompts x {cfg.rollout.group_size} samples / {cfg.train.minibatches_per_iteration}"
              f" minibatches / DP {lay.dp} / {cfg.train.microbatches_per_minibatch} micro-batches)",
              flush=True)
        prec = cfg.precision
        print(f"  precision: params {prec.params_dtype}, fp8 {prec.fp8 or 'off'}"
              f"{' (' + prec.fp8_recipe + ')' if prec.fp8 else ''}, recompute "
              f"{cfg.train.recompute}; rollout engine {cfg.rollout.engine}", flush=True)
        if cfg.rollout.engine == "local":
            # The rollout copy of the policy doubles the weights (no grads/optimizer).
            print(f"  + rollout copy weights {est.weights / layout.GIB:8.4f} GiB", flush=True)
    return 0


def _fused_head_chunk(cfg) -> tuple[int, int] | None:
    """The fused LM head's logits chunk (train.fused_head), or None: the logits materialised."""
    if not cfg.train.fused_head:
        return None
    from megatron_pdm.parallel.fused_head import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK

    return DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK
