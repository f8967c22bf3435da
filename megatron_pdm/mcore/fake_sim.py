"""One simulated rank of a real layout on fake tensors: the fake world, its stand-ins, the memory.

What: `fake_world(rank=, world=, tp=, ep=, pp=)` makes this process rank `rank` of a world of
`world` ranks on torch's fake process group (`FakeStore` + backend "fake": every collective is a
no-op that returns tensors of the right shape), initialises megatron-core's parallel_state for the
layout and enters `SimFakeMode`, a `FakeTensorMode`: every tensor created inside has a shape,
dtype and device but no storage, so a 48-layer, 128-expert model "exists" in a few hundred MiB of
host memory. `storage_bytes` / `category_bytes` count what the tensors would occupy.

Why a simulation: shape, sharding, padding and device bugs of the real recipe only show at its
real sizes, and its per-rank memory can be read off without a GPU.

The device: fake *CPU* tensors. On a CPU build of torch fake CUDA tensors can be created, but
Python indexing of one (`a[:2]`) fails ("PyTorch is not linked with support for cuda devices",
results/simulate/feasibility.md), so the simulation runs the project's own CPU path: the CPU
shim (mcore/cpu_shim.py) maps megatron's `torch.cuda.current_device()` to "cpu". A real CPU
tensor meeting a fake one is refused (`allow_non_fake_inputs=False`); the only real tensors let
through are the stand-ins' own constants below (`real_constant`). A fake tensor created on the
host in the training path (a device bug on a GPU) is caught by the device tags of
mcore/sim_devices.py, entered beside this mode by the simulation.

Stand-ins (named, minimal; each replaces a *value* read the fake mode cannot answer, never a
shape; docs/simulate.md lists them with the error each prevents):
1. `_NoForkTracker`: megatron's CUDA RNG tracker saves and compares RNG states around every
   `fork()` (a value read of a fake tensor, `aten._local_scalar_dense`). Replaced by a tracker
   whose fork is a plain context: RNG values do not exist in a simulation (dropout is 0 anyway).
2. Host scalar reads (`tensor.item()`: the gradient norm in `clip_grad_norm`, the found-inf flag)
   return a placeholder (`SCALAR_PLACEHOLDER`: 1.0 / 1 / False) and are counted in
   `SimFakeMode.scalar_reads`, so the report says how many values were invented.
3. Routing (`balanced_routing_overrides`): megatron's dropless dispatcher sizes its all-to-all and
   its expert splits from the router's token counts (data-dependent shapes). The simulation uses
   megatron's own drop-and-pad mode at capacity factor 1.0: every expert receives exactly
   T*k/E token slots, the memory of perfectly balanced dropless routing; the dispatcher's
   constant counts (`torch.full`) are kept as real host constants so the experts can split on them.
4. Object collectives (`all_gather_object`, `broadcast_object_list`) pickle through a tensor's
   bytes, which a fake tensor has none of: every rank's object is taken to be this rank's
   (`_same_object_collectives`). True for what megatron gathers here (the parameter-group keys,
   identical on all ranks by construction) and for the step metrics broadcast.
5. `device="cuda"` in a factory call becomes "cpu" at the dispatch level too (`SimFakeMode`):
   the CPU shim rewrites devices in a torch-function mode, and autograd runs backward without
   torch-function modes, so megatron's recompute (which rebuilds the causal mask in backward,
   `get_default_causal_mask`, device="cuda") would make a fake CUDA tensor there.
6. megatron's torch fallback of the gradient-norm kernel (`local_multi_tensor_l2_norm`, used
   without apex/TE) builds `torch.tensor(list of 0-d tensors)`, which reads their values: it is
   replaced by the same norm from `torch.stack` (`_l2_norm_from_stack`), no value read.
7. megatron's DDP coalesces its bucket collectives (`torch.distributed._coalescing_manager`),
   whose coalesced c10d ops have no fake kernel: each collective is issued on its own instead
   (`_Uncoalesced`), same groups, same tensors.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

logger = logging.getLogger(__name__)

SCALAR_PLACEHOLDER = {torch.bool: False, "int": 1, "float": 1.0}


class SimFakeMode(FakeTensorMode):
    """FakeTensorMode answering host scalar reads with a placeholder (stand-in 2) and creating
    `device="cuda"` factory outputs on the CPU (stand-in 5)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=False)
        self.scalar_reads = 0
        self.cuda_factories = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = (kwargs or {}).get("device")
        if device is not None and torch.device(device).type == "cuda":
            # the CPU shim's device rewrite is a torch-function mode, which autograd turns off
            # during backward (megatron's recompute builds its causal mask there).
            self.cuda_factories += 1
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
            dtype = args[0].dtype
            if dtype is torch.bool:
                return SCALAR_PLACEHOLDER[torch.bool]
            return SCALAR_PLACEHOLDER["float" if dtype.is_floating_point else "int"]
        return super().__torch_dispatch__(func, types, args, kwargs)


def real_constant(fn, *args, **kwargs) -> torch.Tensor:
    """`fn(*args, **kwargs)` as a real (not fake) host tensor: a stand-in's known constant."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return fn(*args, **kwargs)


class _NoForkTracker:
    """Stand-in 1 for megatron's CudaRNGStatesTracker: same interface, no RNG state."""

    def __init__(self, *args, **kwargs):
        self.states_: dict = {}

    def reset(self):
        self.states_ = {}

    def is_initialized(self) -> bool:
        return True

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.states_[name] = seed

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield


def _rng_patches() -> list[tuple]:
    from megatron.core.tensor_parallel import random as mrandom

    # recompute (CheckpointFunction) saves and restores the CUDA RNG state: no state here.
    return [(mrandom, "_CUDA_RNG_STATE_TRACKER", _NoForkTracker()),
            (mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True),
            (mrandom, "_set_cuda_rng_state", lambda *a, **k: None)]


def _l2_norm_from_stack(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Stand-in 6: the l2 norm of all tensors in `tensor_lists` as a [1] fp32 tensor."""
    norms = [torch.linalg.vector_norm(t.float()) for tl in tensor_lists for t in tl]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _grad_norm_patches() -> list[tuple]:
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl.__name__ != "local_multi_tensor_l2_norm":
        return []  # apex / TE kernel present (not on a CPU machine)
    return [(clip_grads, "l2_norm_impl", _l2_norm_from_stack)]


class _Uncoalesced:
    """Stand-in 7 for `_coalescing_manager(group, async_ops=...)`: no coalescing, a no-op wait."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait(self):
        return None


def _coalescing_patches() -> list[tuple]:
    from megatron.core.distributed import param_and_grad_buffer

    return [(param_and_grad_buffer, "_coalescing_manager", _Uncoalesced)]


def balanced_routing_overrides(arch) -> dict:
    """TransformerConfig overrides of stand-in 3 (empty for a dense model)."""
    if not arch.num_experts:
        return {}
    return dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                moe_token_drop_policy="probs")


def _dispatcher_patches() -> list[tuple]:
    """Stand-in 3's second half: drop-and-pad's constant counts as real host tensors."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    original = D.preprocess

    def preprocess(self, routing_map):
        out = original(self, routing_map)
        if not self.drop_and_pad:
            raise RuntimeError("simulation: the alltoall dispatcher is not in drop-and-pad mode "
                               "(balanced_routing_overrides was not applied)")
        # torch.full constants of the drop-and-pad path (capacity per expert / per rank).
        self.num_global_tokens_per_local_expert = real_constant(
            torch.full, tuple(self.num_global_tokens_per_local_expert.shape), self.capacity,
            dtype=torch.long)
        return real_constant(torch.full, tuple(out.shape),
                             self.capacity * self.tp_size * self.ep_size, dtype=torch.long)

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # the schedule caches the loss scale as a class attribute: a fresh one per simulated rank
    return [(D, "preprocess", preprocess), (MoEAuxLossAutoScaler, "main_loss_backward_scale", None)]


@contextlib.contextmanager
def _patched(patches: list[tuple]) -> Iterator[None]:
    """Sets every (object, attribute, value) and restores the old values on exit: the stand-ins
    never outlive the simulation (a test process goes on with unpatched megatron)."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


@contextlib.contextmanager
def _same_object_collectives() -> Iterator[None]:
    """Stand-in 4: object collectives with every rank holding this rank's object."""
    saved = dist.all_gather_object, dist.broadcast_object_list

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        return None

    dist.all_gather_object, dist.broadcast_object_list = all_gather_object, broadcast_object_list
    try:
        yield
    finally:
        dist.all_gather_object, dist.broadcast_object_list = saved


@contextlib.contextmanager
def fake_world(*, rank: int, world: int, tp: int, ep: int, pp: int) -> Iterator[SimFakeMode]:
    """This process as rank `rank` of `world` on the fake process group, inside `SimFakeMode`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state as ps

    from megatron_pdm.mcore.cpu_shim import apply_cpu_shim

    if not 0 <= rank < world:
        raise ValueError(f"simulated rank {rank} is outside the world of {world}")
    apply_cpu_shim()
    if dist.is_initialized():
        raise RuntimeError("simulation: torch.distributed is already initialised in this process")
    # megatron's parallel-state globals can outlive their process group (a caller that destroyed
    # the group but not megatron's state, e.g. an earlier test in this process): with no group
    # alive they are dead handles, and initialize_model_parallel would refuse them
    ps.destroy_model_parallel()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # gloo side groups cannot be created on a fake store (ProcessGroupGloo internal assert).
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
            create_gloo_process_groups=False)
        patches = (_rng_patches() + _dispatcher_patches() + _grad_norm_patches()
                   + _coalescing_patches())
        mode = SimFakeMode()
        with _patched(patches), _same_object_collectives(), mode:
            yield mode
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        seen[id(st) if not hasattr(st, "_cdata") else st._cdata] = st.nbytes()
    return sum(seen.values())


def _optimizer_state_tensors(optimizer) -> tuple[list, list]:
    """(fp32 main-param copies, Adam state tensors) of a megatron (chained) optimizer."""
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    main, state = [], []
    for opt in subs:
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups",
                     "shard_fp32_groups"):
            for group in getattr(opt, attr, []) or []:
                main.extend(group)
        for st in opt.optimizer.state.values():
            state.extend(v for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return main, state


def category_bytes(ddp_model, optimizer) -> dict[str, int]:
    """Static memory of one rank by category (bytes): parameters, gradient buffers, optimizer."""
    params = [p for p in ddp_model.module.parameters()]
    grads = []
    for buffers in (getattr(ddp_model, "buffers", []), getattr(ddp_model, "expert_parallel_buffers", [])):
        grads.extend(b.grad_data for b in buffers)
    main, state = _optimizer_state_tensors(optimizer)
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(grads),
            "optimizer_main_params": storage_bytes(main),
            "optimizer_adam_state": storage_bytes(state)}


class PeakTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Live bytes of the storages created inside it, and their peak (activations and temporaries).

    Entered inside `SimFakeMode`: every new storage an op returns (not an input's: in-place ops
    and views allocate nothing) is counted once while a Python reference to it lives (a weak reference's callback subtracts it when it is freed).
    `peak_top` lists the largest storages live at the peak (bytes, the op that made them).
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[int, str]] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.peak_top: list[tuple[int, str]] = []
        self._snapped = 0

    def _track(self, t: torch.Tensor, op: str) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        n = st.nbytes()
        self._live[key] = (n, op)
        self.current += n
        if self.current > self.peak:
            self.peak = self.current
            if self.peak > 1.01 * self._snapped:  # re-list the largest at most every +1%
                self._snapped = self.peak
                self.peak_top = sorted(self._live.values(), reverse=True)[:8]

        def freed(_ref, key=key):
            self.current -= self._live.pop(key, (0, ""))[0]
            self._refs.pop(key, None)

        # the storage object lives as long as a tensor on it does
        self._refs[key] = weakref.ref(st, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # in-place ops and views return an input's storage: not an allocation (it may predate
        # the tracker, like the gradient buffers megatron zeroes in place)
        inputs = {t.untyped_storage()._cdata
                  for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._track(t, str(func.overloadpacket.__name__))
        return out
