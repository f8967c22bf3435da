"""The study's Probe over a run's real megatron model and optimizer (any TP / EP / DP / PP).

- `evaluate()` runs megatron's schedule forward-only (`collect_non_loss_data=True`) over this
  DP rank's micro-batches; the "loss function" computes the vocab-parallel `token_stats` of the
  logits shard with training's own call (`mcore/loss_adapter.batch_token_stats`: the same op and
  the same batch facts: temperature, engine vocab, validation state, TP group) and the study's
  `token_table`. Tables are gathered over DP and sent from the last pipeline stage to every
  stage, so every rank holds the whole study batch's table (TP ranks hold identical tables: the
  op's statistics are replicated after its all-reduces).
- `step(cfg)` is the driver's own optimizer step (`train/schedule.optimizer_step`: zero grads,
  megatron forward/backward with `mcore/loss_adapter.make_loss_func(mb, cfg)`, the run's optimizer
  with its Adam state, gradient clipping and DP/TP reductions).
- the decomposition controls: `step_momentum()` is the optimizer's step with every gradient
  buffer zero (no forward/backward: Adam moves by its momentum alone, plus weight decay if the
  run has any); `step_gradient(cfg, lr)` runs the same forward/backward as `step` and moves each
  parameter by -lr * its finalised `main_grad` (plain SGD, no optimizer state, no clipping).
- `snapshot` / `restore` / `verify` are `analysis/snapshot.py` on this rank; `verify` makes every
  rank see the worst rank's result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pdm.analysis import snapshot as snap_mod
from megatron_pdm.analysis.token_table import TokenTable, state_hashes, token_table
from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.mcore import loss_adapter
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.mcore.device import current_device, to_device
from megatron_pdm.train.schedule import forward_backward, optimizer_step

__all__ = ["MegatronProbe", "verify_all_ranks"]


class MegatronProbe:
    """Probe of `seed_study.measure_seed` over a DDP-wrapped GPTModel and megatron optimizer.

    Args:
        model: the run's megatron DDP model.
        optimizer: the run's megatron optimizer (state loaded from the checkpoint).
        microbatches: this DP rank's `PackedBatch` micro-batches of the study minibatch.
        criteria: the study criteria (their masks and directions go into the tables).
        pp: pipeline-parallel size.
        stats_dtype: dtype the logits shard is cast to before `token_stats` in `evaluate`
            (float64 by default: D and Ddot of near-deterministic tokens change by ~1e-7 per
            step, the size of fp32 rounding in the statistics; the training steps are untouched).
            float32 halves the evaluation memory of a large-vocabulary model.
    """

    def __init__(self, model, optimizer, microbatches: list, criteria: list, *, pp: int,
                 stats_dtype: torch.dtype = torch.float64):
        if not microbatches:
            raise ValueError("MegatronProbe: this data-parallel rank has no micro-batch; use at "
                             "least DP x microbatches_per_minibatch samples per minibatch")
        self.model = model
        self.optimizer = optimizer
        self.microbatches = microbatches
        self.criteria = criteria
        self.pp = pp
        self.stats_dtype = stats_dtype
        from megatron_pdm.mcore.lm_head import lm_head_of

        self.head = lm_head_of(model)  # the run's train.fused_head (None: logits)

    # ------------------------------------------------------------------ evaluation

    def _table_of(self, output_tensor: torch.Tensor, mb) -> TokenTable:
        # The training step's batch -> token_stats call, on a copy in the statistics dtype (bs
        # row order, the order of state_hashes(mb.tokens); the output itself is unused).
        out = loss_adapter.batch_token_stats(output_tensor, mb, stats_dtype=self.stats_dtype,
                                             head=self.head)
        f = out.fields
        return token_table(out.stats, f["advantages"], f["behavior_logprob"], f["loss_mask"],
                           self.criteria, seq_ids_N=f["seq_ids"],
                           states_N2=state_hashes(mb.tokens))

    def evaluate(self) -> TokenTable:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        tables: list[TokenTable] = []
        mbs = self.microbatches

        def forward_step(data_iterator, model):
            mb = to_device(next(data_iterator))  # as the training step: batches packed on CPU
            output = model(mb.tokens, mb.position_ids, attention_mask=None)

            def collect(output_tensor, non_loss_data=False):
                table = self._table_of(output_tensor, mb)
                tables.append(table)
                return table

            return output, collect

        b, s = mbs[0].tokens.shape
        self.model.eval()
        try:
            with torch.no_grad():
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model],
                    num_microbatches=len(mbs), seq_length=s, micro_batch_size=b,
                    forward_only=True, collect_non_loss_data=True)
        finally:
            self.model.train()
        local = TokenTable.cat(tables)
        dp_group = ps.get_data_parallel_group()
        if dist.get_world_size(dp_group) > 1:
            parts = [None] * dist.get_world_size(dp_group)
            # Object all-gather over DP: each rank contributes its micro-batches' rows, in DP
            # rank order (= the minibatch's sample order, as the driver splits it).
            dist.all_gather_object(parts, local.columns, group=dp_group)
            local = TokenTable.cat([TokenTable(p) for p in parts])
        if self.pp > 1:
            box = [local.columns]
            # Object broadcast over the pipeline group: only the last stage computed the tables.
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            local = TokenTable(box[0])
        return local

    # ------------------------------------------------------------------ step and state

    def step(self, cfg: PolicyLossConfig) -> None:
        optimizer_step(self.model, self.optimizer, self.microbatches,
                       lambda mb: loss_adapter.make_loss_func(mb, cfg, head=self.head),
                       pp=self.pp)

    def step_momentum(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.optimizer.step()  # zero gradients: Adam's displacement from its moments alone

    @torch.no_grad()
    def _sgd(self, lr: float) -> None:
        for p in self.model.module.parameters():
            if p.requires_grad:
                p.add_(p.main_grad.to(p.dtype), alpha=-lr)

    def step_gradient(self, cfg: PolicyLossConfig, lr: float) -> None:
        from megatron.core import parallel_state as ps

        if (mopt.uses_distributed_optimizer(self.optimizer)
                and dist.get_world_size(ps.get_data_parallel_group()) > 1):
            # the DistributedOptimizer reduce-scatters gradients over DP: each rank's buffer
            # holds the reduced gradient of its own shard only
            raise ValueError("the own-gradient control (--sgd-lr) needs DP = 1 or "
                             "parallel.use_distributed_optimizer=false")
        forward_backward(self.model, self.optimizer, self.microbatches,
                         lambda mb: loss_adapter.make_loss_func(mb, cfg, head=self.head),
                         pp=self.pp)
        self._sgd(lr)

    def snapshot(self) -> snap_mod.StateSnapshot:
        return snap_mod.take_snapshot(self.model, self.optimizer)

    def restore(self, snap: snap_mod.StateSnapshot) -> None:
        snap_mod.restore_snapshot(snap, self.model, self.optimizer)

    def verify(self, snap: snap_mod.StateSnapshot) -> list[str]:
        return verify_all_ranks(snap, self.model, self.optimizer)


def verify_all_ranks(snap: snap_mod.StateSnapshot, model, optimizer) -> list[str]:
    """`snapshot.verify_snapshot` on this rank, made collective: non-empty on every rank when
    any rank's state differs from its snapshot (so all ranks raise together, none hangs)."""
    bad = snap_mod.verify_snapshot(snap, model, optimizer)
    worst = torch.tensor([len(bad)], dtype=torch.int64, device=current_device())
    # MAX all-reduce over all ranks of the number of differing entries.
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if int(worst) and not bad:
        bad = [f"another rank ({int(worst)} entries)"]
    return bad
