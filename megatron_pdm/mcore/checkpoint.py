"""Save and resume the trainer with megatron-core dist-checkpointing.

Layout: `<save_dir>/iter_<NNNNNNN>/` is one dist-checkpoint holding the model's and the
optimizer's sharded state dicts plus a `train_state` common entry (step counters, RNG states,
rollout-engine counters), and a `manifest.json` (size and sha256 of every file, the run id and
identity). It is written to a temporary directory and renamed into place when complete; the file
rules (publish, `latest`, rotation, verification) are in ckpt_files.py and docs/checkpoints.md.

Model tensors are saved as sharded tensors with global shapes, so a checkpoint written at one
TP/EP layout loads at another (used by the TP=1 vs TP=2 loss test).

DistributedOptimizer without apex/TE needs the §5.3 workarounds of docs/cpu-megatron.md; they are
applied here (see megatron_pdm.mcore.optimizer) and verified bit-exact by the resume test.

An optimizer that has not stepped yet (a run without warm-up saves at iteration 0) has no Adam
state, and megatron's DistributedOptimizer cannot describe one without apex/TE
(`distrib_optimizer.state_dict`: `assert len(steps) == 1` over an empty state). Such a checkpoint
holds the model only (`optimizer_saved: false` in its common state) and loading it leaves the
optimizer fresh, which is exactly the state it was saved in.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from megatron_pdm.mcore import ckpt_files as files
from megatron_pdm.mcore import optimizer as mopt

logger = logging.getLogger(__name__)

LATEST = files.LATEST


def latest_checkpoint(save_dir: str) -> str | None:
    """Path of the newest published checkpoint, verified against its manifest, or None."""
    return files.find_resume(save_dir)


def _model_sd(ddp_model):
    return ddp_model.module.sharded_state_dict() if hasattr(ddp_model, "module") else (
        ddp_model.sharded_state_dict())


def save_checkpoint(save_dir: str, iteration: int, ddp_model, optimizer, train_state: dict,
                    *, keep_last: int = 2, run_id: str = "", identity: dict | None = None,
                    hook=None) -> str:
    """Collective: every rank calls it. Returns the checkpoint path.

    Written to `<save_dir>/.iter_N.tmp`, manifested and renamed into place by rank 0 (see
    ckpt_files); `hook(phase)` runs on rank 0 between the steps."""
    from megatron.core import dist_checkpointing

    hook = hook or (lambda phase: None)
    tmp = files.tmp_path(save_dir, iteration)
    if dist.get_rank() == 0:
        files.prepare_tmp(save_dir, iteration)
        hook("tmp")
    dist.barrier()  # the temporary directory exists before any rank writes into it
    dist_checkpointing.save(checkpoint_state(ddp_model, optimizer, train_state), tmp)
    dist.barrier()  # every rank's shards are written before rank 0 digests them
    path = os.path.join(save_dir, files.ckpt_name(iteration))
    if dist.get_rank() == 0:
        hook("written")
        files.write_manifest(tmp, run_id=run_id, iteration=iteration, identity=identity or {})
        hook("manifest")
        files.publish(save_dir, iteration, tmp, run_id=run_id, keep_last=keep_last, hook=hook)
    dist.barrier()  # no rank returns before the checkpoint is published
    logger.info("saved checkpoint %s", path)
    return path


def checkpoint_state(ddp_model, optimizer, train_state: dict) -> dict:
    """The sharded state dict `save_checkpoint` writes: the model's, the optimizer's (once it has
    state) and the common entries (the simulation plans the same dict: mcore/ckpt_plan.py)."""
    model_sd = _model_sd(ddp_model)
    metadata = mopt.DIST_OPT_METADATA if mopt.uses_distributed_optimizer(optimizer) else None
    with_optimizer = has_optimizer_state(optimizer)
    state = {"model": model_sd, "train_state": train_state, "optimizer_saved": with_optimizer}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False,
                                                          metadata=metadata)
    return state


def has_optimizer_state(optimizer) -> bool:
    """False until the first optimizer step (Adam has no state yet)."""
    return any(len(sub.optimizer.state) > 0 for sub in mopt.sub_optimizers(optimizer))


def load_model(path: str, ddp_model_or_module) -> None:
    """Loads only model weights (any TP/EP layout) from a checkpoint written by `save_checkpoint`
    or `save_model`. Collective."""
    from megatron.core import dist_checkpointing

    module = getattr(ddp_model_or_module, "module", ddp_model_or_module)
    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, path)
    module.load_state_dict(loaded["model"], strict=False)


def save_model(path: str, module) -> None:
    """Saves only the model's sharded state dict (e.g. for resharding in tests). Collective."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": module.sharded_state_dict()}, path)
    dist.barrier()


def load_checkpoint(path: str, ddp_model, optimizer) -> dict:
    """Restores model and optimizer in place; returns the saved `train_state`. Collective."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    if not common.get("optimizer_saved", True):
        # Saved before the first optimizer step: the model only; the optimizer stays fresh.
        load_model(path, ddp_model)
        for sub in mopt.sub_optimizers(optimizer):
            if hasattr(sub, "reload_model_params"):  # fp32 main copies of 16-bit params
                sub.reload_model_params()
        logger.info("loaded checkpoint %s (model only: saved before the first step)", path)
        return common["train_state"]
    distributed_opt = mopt.uses_distributed_optimizer(optimizer)
    if distributed_opt:
        mopt.prime_for_loading(ddp_model, optimizer)  # §5.3 (1)
    model_sd = _model_sd(ddp_model)
    metadata = mopt.DIST_OPT_METADATA if distributed_opt else None
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata),
    }
    loaded = dist_checkpointing.load(state, path)
    module = getattr(ddp_model, "module", ddp_model)
    module.load_state_dict(loaded["model"], strict=False)
    with torch.no_grad():  # §5.3 (2): main params are views of fp32 model params
        optimizer.load_state_dict(loaded["optimizer"])
    if distributed_opt:
        mopt.fix_adam_step_after_load(optimizer, loaded["optimizer"])  # §5.3 (3)
    logger.info("loaded checkpoint %s", path)
    return common["train_state"]
