"""Where the study's out-of-region tokens come from: the batch, its minibatches, the steps before.

A token is out of region when the training policy pi has moved away from the behaviour policy mu
that generated it. RL gets that distance from three places, and the study can take each:

    drift      (default) the driver's own steps on minibatches 0..j-1 of the same batch move pi
               inside the iteration; the study minibatch is j (default: the last one).
    precision  the engine copy differs from the trainer (rollout.rollout_precision: bf16, or
               the local engine's simulated fp8 with rollout.local.fp8_scales): minibatch 0, no
               step before it, so D is the engine mismatch alone.
    stale      the batch is generated at the start state, then `stale_iterations` whole driver
               iterations (fresh batches at the current weights, the run's loss, every
               minibatch) train before the study: behaviour = the policy k iterations old, as
               with overlapped rollouts (one iteration: rollout.overlap); minibatch 0 by
               default.

All three run the driver's own building blocks: the prompts `task.problems(seed, iteration, P)`,
the engine (the local engine's sampling generator seeded per batch), Dr.GRPO advantages,
`schedule.minibatch_plan` / `dp_microbatches`, `schedule.optimizer_step` with the lr the run's
schedule gives each step (`schedule.rl_lr`).
"""

from __future__ import annotations

from megatron_pdm.configtree import ConfigError
from megatron_pdm.mcore import loss_adapter
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.train import schedule as sched
from megatron_pdm.train.model_setup import seq_multiple
from megatron_pdm.train.rollout.feed import sampling_params
from rollout_bridge.core.packing import pack_padded
from rollout_bridge.core.types import RolloutBatch, group_advantages

__all__ = ["SOURCES", "advance_iterations", "default_minibatch", "driver_steps", "fresh_batch",
           "minibatches", "seed_engine"]

SOURCES = ("drift", "precision", "stale")


def default_minibatch(source: str, minibatches_per_iteration: int) -> int:
    """The study minibatch when --minibatch is not given (module docstring)."""
    return minibatches_per_iteration - 1 if source == "drift" else 0


def seed_engine(rollout, seed: int) -> bool:
    """Seeds the local engine's sampling generator with `seed` (False: a server engine)."""
    engine = getattr(rollout, "engine", None)
    if engine is None or not hasattr(engine, "load_state_dict"):
        return False
    state = dict(engine.state_dict(), seed=int(seed), calls=0)
    engine.load_state_dict(state)
    return True


def fresh_batch(trainer, seed: int, iteration: int, *, engine_seed: int | None = None
                ) -> RolloutBatch:
    """The rollout of rl_iteration at `iteration` with the driver seed replaced by `seed` (the
    engine samples from the weights it was last synced to; its generator is seeded by
    `engine_seed`, default `seed`)."""
    r, task = trainer.cfg.rollout, trainer.task
    seed_engine(trainer.rollout, seed if engine_seed is None else engine_seed)
    problems = task.problems(seed, iteration, r.prompts_per_iteration)
    batch = trainer.rollout.generate([task.prompt_ids(q) for q in problems],
                                     sampling_params(task, r.temperature), r.group_size)
    batch.set_rewards([task.score(problems[s.group_index], s.response_ids.tolist())
                       for s in batch.samples])
    return batch


def minibatches(trainer, batch: RolloutBatch, seed: int, iteration: int) -> list[list]:
    """This DP rank's micro-batches of every minibatch of `batch`, from the driver's own plan
    (train/schedule.py) for (seed, iteration)."""
    cfg = trainer.cfg
    packed = pack_padded(batch, group_advantages(batch), pad_id=trainer.task.pad_id,
                         pad_to_multiple_of=seq_multiple(cfg))
    chunks = sched.minibatch_plan(seed, iteration, len(batch.samples),
                                  cfg.train.minibatches_per_iteration)
    return [[packed.select_rows(m) for m in sched.dp_microbatches(
        c, dp_size=trainer.info.dp_size, dp_rank=trainer.info.dp_rank,
        microbatches=cfg.train.microbatches_per_minibatch)] for c in chunks]


def driver_steps(trainer, mbs_list: list[list], step0: int, loss_cfg=None) -> list[float]:
    """The driver's optimizer steps on `mbs_list` (one step per minibatch) with the run's loss
    (or `loss_cfg`), step k at the schedule's lr for RL step step0 + k; returns the lrs the
    optimizer ran at (read back from it)."""
    cfg = trainer.cfg
    loss = cfg.loss if loss_cfg is None else loss_cfg
    applied = []
    for k, mbs in enumerate(mbs_list):
        mopt.set_lr(trainer.optimizer, sched.rl_lr(cfg.train, step0 + k))
        applied.append(trainer.optimizer.param_groups[0]["lr"])
        sched.optimizer_step(trainer.model, trainer.optimizer, mbs,
                             lambda mb: loss_adapter.make_loss_func(mb, loss, head=trainer.head),
                             pp=cfg.parallel.pp)
    return applied


def advance_iterations(trainer, seed: int, iteration: int, k: int, step0: int) -> list[float]:
    """`k` whole driver iterations from the current state (the stale source): iteration i
    generates a fresh batch at the current weights (engine seeded by (seed, i)), trains every
    minibatch with the run's loss, then syncs the engine. Returns the lrs of those steps.

    Raises:
        ConfigError: k < 1.
    """
    if k < 1:
        raise ConfigError(f"stale_iterations={k}: the stale source needs at least 1 iteration")
    m = trainer.cfg.train.minibatches_per_iteration
    lrs = []
    for i in range(k):
        it = iteration + 1 + i
        batch = fresh_batch(trainer, seed, it, engine_seed=seed * 1000 + 1 + i)
        lrs += driver_steps(trainer, minibatches(trainer, batch, seed, it), step0 + i * m)
        trainer.sync_weights()  # the next generation samples from the trained weights
    return lrs
