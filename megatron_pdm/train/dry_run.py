"""`--dry-run`: validate the run's parallel layout and print a per-GPU memory estimate.

Never initialises torch.distributed and never builds the model: it only reads the config and
calls megatron_pdm.layout (`validate_layout`, `estimate_memory`, `format_report`). The world size
is torchrun's WORLD_SIZE when set, else TP x EP (the smallest world for the layout).
"""

from __future__ import annotations

import logging
import os

from megatron_pdm.train.config import RunConfig

logger = logging.getLogger(__name__)


def dry_run(cfg: RunConfig) -> int:
    """Prints the layout report (rank 0 / single process). Returns a process exit code."""
    from megatron_pdm import layout
    from megatron_pdm.train.task import AdditionTask, Tokenizer
    from megatron_pdm.train.trainer_arch import make_arch

    p = cfg.parallel
    tok = Tokenizer(num_filler_tokens=cfg.task.num_filler_tokens)
    task = AdditionTask(cfg.task.num_digits, tok)
    arch = make_arch(cfg, tok.vocab_size)
    world = int(os.environ.get("WORLD_SIZE", p.tp * p.ep))
    try:
        lay = layout.validate_layout(arch, world_size=world, tp=p.tp, pp=1, ep=p.ep, etp=1)
    except ValueError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dry run: invalid layout\n{err}", flush=True)
        return 2
    seq = task.prompt_len + task.answer_len
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    micro = max(1, samples // (cfg.train.minibatches_per_iteration * lay.dp
                               * cfg.train.microbatches_per_minibatch))
    est = layout.estimate_memory(arch, lay, micro_batch_size=micro, seq_length=seq,
                                 params_dtype="fp32",
                                 distributed_optimizer=p.use_distributed_optimizer)
    if int(os.environ.get("RANK", "0")) == 0:
        # The rollout copy of the policy doubles the weights (no grads/optimizer).
        print(layout.format_report(arch, lay, est), flush=True)
        print(f"  + rollout copy weights {est.weights / layout.GIB:8.4f} GiB", flush=True)
    return 0
