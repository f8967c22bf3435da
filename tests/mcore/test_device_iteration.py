"""No tensor off the driver's device in a real RL iteration (stand-in CUDA device on CPU).

`tests/support/_device_trace.py` makes `torch.cuda.current_device()` a device other than the host
memory (tags by storage, CPU numerics) and records every op a GPU would refuse: a device tensor
meeting a host one, a host tensor in a collective over an NCCL group, `.numpy()` of a device tensor.
Under it the driver's own code runs, in one gloo process (two for TP=2 with sequence
parallelism), with the tiny CPU config:
`Trainer(cfg)` (model, engine copy, DDP, megatron optimizer), one supervised warm-up step, the
weight sync, one RL iteration (rollout through the engine copy, rewards, packing, the loss with
the behaviour log-probs, optimizer step, sync), the live HF export, the study's probe
(forward-only token table, a step, snapshot + restore) and a checkpoint save + resume followed by
a second iteration. Then every parameter, gradient buffer, optimizer state and main parameter,
the engine copy and the exported tensors must be on the device, and no violation recorded.

Both megatron initialisations: `use_cpu_initialization=False` (a GPU run: megatron allocates on
`torch.cuda.current_device()`, plain-torch modules do not) with the DistributedOptimizer, and
CPU initialisation with the plain optimizer (nothing but the driver moves the weights).

Each check can fail: the same run with the driver's batch move removed records the embedding
meeting host token ids, and a trainer whose models are not placed (CPU initialisation) records
host weights meeting device inputs.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.support._dist import run_gloo

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml")


def _cfg(out: str, distributed_optimizer: bool, tp: int = 1):
    from megatron_pdm.train.config import RunConfig

    return RunConfig.load(TINY, [
        f"parallel.tp={tp}",
        f"parallel.use_distributed_optimizer={str(distributed_optimizer).lower()}",
        "rollout.prompts_per_iteration=2", "rollout.group_size=2",
        "train.minibatches_per_iteration=1", "train.eval_prompts=2", "train.iterations=3",
        "warmup.steps=1", "warmup.batch_size=2", "warmup.stop_at_accuracy=null",
        "checkpoint.save_interval=1", f"output_dir={out}", "log.tensorboard=false",
        "log.plot=false", "log.progress=false"])


def _off_device(trace, named) -> list[str]:
    return [name for name, t in named if t.numel() > 0 and not trace.on_device(t)]


def _state_tensors(tr):
    """(name, tensor) of the model, its gradient buffers, the optimizer and the engine copy."""
    from megatron_pdm.mcore import optimizer as mopt

    out = list(tr.module.named_parameters()) + list(tr.module.named_buffers())
    out += [(f"{n}.main_grad", p.main_grad) for n, p in tr.module.named_parameters()
            if getattr(p, "main_grad", None) is not None]
    for i, sub in enumerate(mopt.sub_optimizers(tr.optimizer)):
        for g in sub.optimizer.param_groups:
            out += [(f"opt{i}.main_param", p) for p in g["params"]]
        for st in sub.optimizer.state.values():
            # torch Adam keeps `step` a 0-dim host tensor on a GPU too (not capturable)
            out += [(f"opt{i}.{k}", v) for k, v in st.items() if torch.is_tensor(v) and v.dim()]
    out += [(f"engine.{n}", p) for n, p in tr.rollout.engine.model.named_parameters()]
    return out


def _study_probe(tr):
    """The mask study's probe on this iteration's batch: evaluate, one step, snapshot/restore."""
    from megatron_pdm.analysis import snapshot
    from megatron_pdm.analysis.criteria import build_criteria
    from megatron_pdm.analysis.megatron_probe import MegatronProbe
    from megatron_pdm.train.model_setup import seq_multiple
    from rollout_bridge.core.packing import pack_padded
    from rollout_bridge.core.types import group_advantages

    cfg = tr.cfg
    problems = tr.task.problems(cfg.seed, 0, cfg.rollout.prompts_per_iteration)
    batch = tr._generate(problems, cfg.rollout.temperature, cfg.rollout.group_size)
    batch.set_rewards([tr.task.score(problems[s.group_index], s.response_ids.tolist())
                       for s in batch.samples])
    packed = pack_padded(batch, group_advantages(batch), pad_id=tr.task.pad_id,
                         pad_to_multiple_of=seq_multiple(cfg))
    criteria = build_criteria(["ratio", "pdm-agg"], cfg.loss, delta_kl=0.05, delta_tv=0.1)
    probe = MegatronProbe(tr.model, tr.optimizer, [packed], criteria, pp=1)
    snap = snapshot.take_snapshot(tr.model, tr.optimizer)
    probe.evaluate()
    probe.step(criteria[1].cfg)
    snapshot.restore_snapshot(snap, tr.model, tr.optimizer)
    assert not probe.verify(snap)


def _worker(rank, world, out, gpu_init, distributed_optimizer, tp):
    from megatron_pdm.convert.live import gather_hf_state_dict
    from megatron_pdm.mcore import device as dev
    from megatron_pdm.mcore.cpu_shim import apply_cpu_shim
    from megatron_pdm.train import model_setup as ms
    from megatron_pdm.train import schedule
    from megatron_pdm.train import trainer as trainer_mod
    from megatron_pdm.train.logging_utils import MetricsWriter
    from tests.support._device_trace import DeviceTrace

    apply_cpu_shim()
    if gpu_init:  # what transformer_config chooses on a GPU
        kwargs = ms.megatron_kwargs
        ms.megatron_kwargs = lambda cfg: dict(kwargs(cfg), use_cpu_initialization=False)
    cfg = _cfg(out, distributed_optimizer, tp)
    with DeviceTrace() as trace:
        tr = trainer_mod.Trainer(cfg)
        writer = MetricsWriter(out, resume_step=None, tensorboard=False, wandb=None)
        tr.warmup()
        tr.sync_weights()
        tr.rl_iteration(writer)
        hf = gather_hf_state_dict(tr.module, tr.arch, device=None)  # the live export
        _study_probe(tr)
        tr.save()
        assert tr._restore()
        tr.rl_iteration(writer)
        ops_on_device = trace.device_ops
        off = _off_device(trace, _state_tensors(tr) + list(hf.items()))
        found = list(trace.violations)
        # the same driver with its batch move removed: token ids stay in host memory
        schedule.to_device = lambda batch: batch
        tr.rl_iteration(writer)
        unmoved = trace.violations[len(found):]
        schedule.to_device = dev.to_device
    assert ops_on_device > 1000, ops_on_device  # the device was really in use
    assert not off, f"left in host memory: {off[:10]} ({len(off)} tensors)"
    assert not found, trace.report()
    assert any("embedding" in v for v in unmoved), unmoved[:3]


def _unplaced_worker(rank, world, out):
    from megatron_pdm.mcore.cpu_shim import apply_cpu_shim
    from megatron_pdm.train.rollout import factory as rollout_mod
    from megatron_pdm.train import trainer as trainer_mod
    from tests.support._device_trace import DeviceTrace

    apply_cpu_shim()
    trainer_mod.place = rollout_mod.place = lambda module: module  # the driver before the fix
    with DeviceTrace() as trace:
        tr = trainer_mod.Trainer(_cfg(out, False))
        tr.sync_weights()
        tr.warmup()
    assert any("mixes device tensors with host" in v for v in trace.violations), trace.report()


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("gpu_init,distributed_optimizer,tp", [
    (True, True, 1), (False, False, 1), (True, True, 2)],
    ids=["gpu-init-distopt", "cpu-init-adam", "tp2-sequence-parallel"])
def test_rl_iteration_stays_on_the_device(tmp_path, gpu_init, distributed_optimizer, tp):
    run_gloo(_worker, tp, str(tmp_path / "run"), gpu_init, distributed_optimizer, tp)


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.slow
def test_unplaced_model_is_caught(tmp_path):
    run_gloo(_unplaced_worker, 1, str(tmp_path / "run"))
