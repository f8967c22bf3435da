"""The trainer's rollout batches: the sampling parameters, and the overlap of `rollout.overlap`.

`sampling_params` is the one sampling-params dict every generation of the driver sends (the
iteration's rollouts, the greedy evaluations, the mask study's fresh batches, the real-vLLM
check): temperature, the task's response cap and its end-of-sequence token.

`RolloutFeed` hands the trainer the batch of each iteration. Without overlap it generates it on
the spot. With `rollout.overlap` (server engines only): right after batch i is available, the
prompts of iteration i+1 are submitted (rank 0 generates them in a background thread against
the weights batch i was generated with, server.py), iteration i trains meanwhile, and batch i+1
is collected (`collect_next`) before the weight sync (the server must be idle during a push).
So from the second iteration on every batch is one version stale (`rollout/staleness` = 1; the
loss's mu is that older policy); the first iteration is generated synchronously. Checkpoints are
taken after that collect: they hold the collected, not yet trained batch (`encode_ready`, the
trainer's `train_state["overlap_batch"]`), so a resumed run trains on exactly the batch the
uninterrupted run would have; no generation is ever pending at a checkpoint.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from megatron_pdm.train.rollout import store


def sampling_params(task, temperature: float) -> dict:
    """The sampling parameters of one generation for `task` at `temperature` (0: greedy)."""
    return {"temperature": temperature, "max_new_tokens": task.max_new_tokens,
            "stop_token_ids": [task.eos_id]}


class RolloutFeed:
    """The batches of a run's iterations from its rollout source (factory.py).

    Args:
        rollout: the rollout source (`generate`; with overlap also `submit` / `collect`).
        task: the run's task (problems, prompt ids, the response cap, eos).
        cfg: the RunConfig (seed, rollout.*, train.iterations).

    `ready` is the collected batch of the next iteration to train ((problems, batch), or None)
    and `ready_wait_s` how long the last collect waited for it.
    """

    def __init__(self, rollout, task, cfg):
        self.rollout = rollout
        self.task = task
        self.cfg = cfg
        # rollout.overlap: the generation in flight, and the collected batch of the iteration
        self._pending = None
        self.ready: tuple[list, object] | None = None
        self.ready_wait_s = 0.0

    def generate(self, problems: list, temperature: float, n: int):
        """Collective: `n` samples for each problem, now."""
        return self.rollout.generate([self.task.prompt_ids(q) for q in problems],
                                     sampling_params(self.task, temperature), n)

    @contextmanager
    def aside(self):
        """Context: generations inside it leave the rollout's sampling state (the seeds of the
        next rollouts) as it was, so a mid-run evaluation (`train.eval_interval`) does not
        change the training run. Only between iterations: no overlapped batch is in flight."""
        state = self.rollout.sampling_state()
        try:
            yield
        finally:
            self.rollout.restore_sampling_state(state)

    def iteration_batch(self, iteration: int) -> tuple[list, object]:
        """(problems, batch) of `iteration`; with overlap, also submits the next one."""
        cfg, r = self.cfg, self.cfg.rollout
        if not r.overlap:
            self.ready = None  # a checkpoint from an overlapped run: regenerate instead
            self.ready_wait_s = 0.0
            problems = self.task.problems(cfg.seed, iteration, r.prompts_per_iteration)
            return problems, self.generate(problems, r.temperature, r.group_size)
        # the time the previous iteration waited for this batch (its collect before the sync)
        wait = self.ready_wait_s if self.ready is not None else 0.0
        if self.ready is None:  # first iteration (or a checkpoint without a batch): no overlap
            self._submit(iteration)
            self.collect_next()
        ready, self.ready, self.ready_wait_s = self.ready, None, wait
        if iteration + 1 < cfg.train.iterations:
            self._submit(iteration + 1)  # generated with the weights `ready` came from
        return ready

    def _submit(self, iteration: int) -> None:
        r = self.cfg.rollout
        problems = self.task.problems(self.cfg.seed, iteration, r.prompts_per_iteration)
        pending = self.rollout.submit([self.task.prompt_ids(q) for q in problems],
                                      sampling_params(self.task, r.temperature), r.group_size)
        self._pending = (problems, pending)

    def collect_next(self) -> None:
        """Collective: waits for the submitted generation (if any) and keeps its batch."""
        if self._pending is None:
            return
        t0 = time.time()
        problems, pending = self._pending
        self._pending = None
        self.ready = (problems, self.rollout.collect(pending))
        self.ready_wait_s = time.time() - t0

    def state(self) -> bytes | None:
        """The collected batch for a checkpoint (None: none collected)."""
        return encode_ready(self.ready)

    def load_state(self, blob: bytes | None) -> None:
        self.ready = decode_ready(blob)


def encode_ready(ready) -> bytes | None:
    """The collected overlap batch as plain-container bytes (no pickle of ours, store.py)."""
    return None if ready is None else store.encode_batch(*ready)


def decode_ready(blob: bytes | None):
    return None if blob is None else store.decode_batch(blob)
