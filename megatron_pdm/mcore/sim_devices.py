"""Device tags on the simulation's fake tensors: a host tensor in the training path is an error.

What: `DeviceTagger` (a context entered inside `fake_sim.fake_world`) tags every fake storage
"device" or "host" the way CUDA would place it, and records each aten op that mixes a device
tensor with a non-scalar host tensor (what a GPU refuses: "Expected all tensors to be on the
same device") and each collective on a host tensor (NCCL refuses CPU tensors), with the project
code location (the innermost frame in megatron_pdm/ or rollout_bridge/) and the innermost
frame outside torch (megatron's own, when it is megatron's call).

Why: the simulation runs on fake *CPU* tensors (fake_sim.py's "device" note), so a `torch.zeros(n)`
without `device=` in the loss path lands on the same device as everything else and passes.
With the tags it fails the simulation as it would fail the GPU run.

Tagging rules (tests/support/_device_trace.py's rules for real tensors, on fake storages):
- `device="cuda"` / an int device in a torch call, `.cuda()`, `.to(cuda)` -> "device"; the copy
  of `.to`/`.cuda` gets a new storage (the CPU shim makes them no-ops, a real transfer copies);
  `.cpu()` / `.to("cpu")` / `device="cpu"` (the string) -> "host";
- a Python-level torch call without tensor inputs (torch.zeros(n), torch.tensor(...)) -> "host";
  `device=t.device` (a torch.device object: "wherever t is", unknown here) -> no tag;
- an op's new outputs -> "device" if any input is, else "host" if any input is; views and
  in-place results keep their storage's tag. A factory asked for CUDA at the dispatch level
  (megatron's backward-time factories, which run without torch-function modes) -> "device".
- `torch.cuda.current_device()` returns 0 inside (as on a GPU; "cpu" during backward, where
  such factories are then untagged), so the driver's `to_device()` and megatron's
  `device=torch.cuda.current_device()` buffers are device tensors; the model's parameters are
  tagged "device" once built (`mark_device`: megatron builds them on the GPU there).
- only fake tensors are tagged: the stand-ins' real constants (fake_sim.real_constant) are none.
Allowed mixes (as on CUDA): 0-dim host tensors and Python numbers anywhere; copies
(`copy_`, `_to_copy`), indexing with host indices, `set_`. `ALLOWED_CALLERS` names the
megatron functions allowed to mix (file:function of the innermost non-torch frame); none is
needed on megatron-core 0.16.1 for the recipe's step (docs/simulate.md).

Not tagged: a host factory called during a backward pass (autograd runs backward without
torch-function modes, and at the dispatch level `torch.zeros(n)` and `torch.zeros(n,
device=t.device)` look the same); only its CUDA factories are.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEVICE, HOST = "device", "host"

ALLOWED_MIXED_OPS = frozenset({
    "aten.copy_.default", "aten._to_copy.default", "aten.index.Tensor",
    "aten.index_put_.default", "aten.index_put.default", "aten._index_put_impl_.default",
    "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
    "aten.set_.source_Tensor", "aten.set_.default", "aten.is_same_size.default",
    "aten._has_compatible_shallow_copy_type.default", "aten.is_set_to.default",
})
# "path/under/site-packages.py:function" of megatron code allowed to mix (none needed so far).
ALLOWED_CALLERS: frozenset[str] = frozenset()
_PROJECT = ("/megatron_pdm/", "/rollout_bridge/")
# the simulation's own modules, and the ops' collective door (its callers are the call sites)
_OURS = ("sim_devices.py", "sim_collectives.py", "fake_sim.py", "cpu_shim.py",
         "megatron_pdm/parallel/collectives.py")


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _fakes(obj) -> list[torch.Tensor]:
    return [x for x in tree_leaves(obj) if isinstance(x, FakeTensor)]


def _short(path: str) -> str:
    """A frame's file relative to site-packages or to the repository."""
    for marker in ("site-packages/", "/megatron_pdm/", "/rollout_bridge/"):
        if marker in path:
            return path[path.index(marker) + (len(marker) if marker[0] != "/" else 1):]
    return path


def code_location() -> tuple[str, str]:
    """(innermost frame in megatron_pdm/ or rollout_bridge/, innermost frame outside torch and
    the simulation's own modules), each "file:line function"; "" when there is none."""
    project = caller = ""
    frame = sys._getframe(1)
    while frame is not None and not (project and caller):
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith(_OURS + ("typing_extensions.py",)):
            where = f"{_short(name)}:{frame.f_lineno} {frame.f_code.co_name}"
            caller = caller or where
            if not project and any(p in name for p in _PROJECT):
                project = where
        frame = frame.f_back
    return project, caller


class DeviceTagger:
    """Context: device/host tags on fake storages and the violations found (see module doc)."""

    def __init__(self):
        self._tags: dict[int, str] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.violations: dict[tuple[str, str, str], int] = {}  # (what, project, caller) -> n
        self.device_ops = 0
        self._fmode = _FunctionMode(self)
        self._dmode = _DispatchMode(self)

    def tag(self, t: torch.Tensor) -> str | None:
        if not isinstance(t, FakeTensor):
            return None
        return self._tags.get(t.untyped_storage()._cdata)

    def mark(self, t: torch.Tensor, tag: str | None) -> None:
        if not isinstance(t, FakeTensor):
            return
        st = t.untyped_storage()
        key = st._cdata
        if tag is None:
            self._tags.pop(key, None)
            return
        self._tags[key] = tag
        if key not in self._refs:
            def freed(_ref, key=key):  # the storage is gone: its address may be reused
                self._tags.pop(key, None)
                self._refs.pop(key, None)

            self._refs[key] = weakref.ref(st, freed)

    def mark_device(self, tensors) -> None:
        """Tags `tensors` "device" (the model's parameters: built on the GPU there)."""
        for t in tensors:
            self.mark(t, DEVICE)

    def violation(self, what: str) -> None:
        project, caller = code_location()
        if caller.split(":")[0] + ":" + caller.rsplit(" ", 1)[-1] in ALLOWED_CALLERS:
            return
        key = (what, project, caller)
        self.violations[key] = self.violations.get(key, 0) + 1

    def report(self) -> list[dict]:
        return [{"what": w, "project_frame": p, "caller": c, "count": n}
                for (w, p, c), n in self.violations.items()]

    def __enter__(self) -> "DeviceTagger":
        self._saved_device = torch.cuda.current_device
        # what a GPU rank returns; "cpu" where no torch-function mode runs (backward: a device
        # index there reaches torch's argument parser unrewritten, which refuses it on CPU)
        torch.cuda.current_device = lambda: 0 if torch._C._len_torch_function_stack() else "cpu"
        self._fmode.__enter__()
        self._dmode.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._dmode.__exit__(*exc)
        self._fmode.__exit__(*exc)
        torch.cuda.current_device = self._saved_device
        return False


class _FunctionMode(TorchFunctionMode):
    """Python-level torch calls (entered above the CPU shim's device rewrite, so it sees the
    caller's device arguments): placements, transfers, host factories."""

    def __init__(self, tagger: DeviceTagger):
        super().__init__()
        self.tagger = tagger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tagger = self.tagger
        target, same_as = None, False
        device = kwargs.get("device")
        if device is not None:
            if _is_cuda(device):
                target = DEVICE
            elif isinstance(device, str) and device.startswith("cpu"):
                target = HOST
            else:
                same_as = True  # device=t.device
        if func is torch.Tensor.to:
            for a in args[1:]:
                if _is_cuda(a):
                    target = DEVICE
                elif isinstance(a, str) and a.startswith("cpu"):
                    target = HOST
                elif isinstance(a, torch.Tensor):
                    target = tagger.tag(a) or HOST
        elif func is torch.Tensor.cuda:
            target = DEVICE
        elif func is torch.Tensor.cpu:
            target = HOST
        inputs = _fakes((args, kwargs))
        out = func(*args, **kwargs)
        if target is None:
            if same_as and not inputs:
                for o in _fakes(out):
                    tagger.mark(o, None)
            elif not inputs and not same_as:
                for o in _fakes(out):  # torch.zeros(n), torch.tensor(...): host memory
                    tagger.mark(o, HOST)
            return out
        in_keys = {t.untyped_storage()._cdata for t in inputs}
        for o in _fakes(out):
            if o.untyped_storage()._cdata in in_keys and tagger.tag(o) != target:
                # a transfer copies into the other memory, never shares the storage
                if out is o:
                    out = o = o.clone()  # keeps autograd, like a real transfer
                else:
                    o = o.detach().clone()
            tagger.mark(o, target)
        return out


class _DispatchMode(TorchDispatchMode):
    """aten and c10d ops: the mixed-placement check and tag propagation to new outputs."""

    def __init__(self, tagger: DeviceTagger):
        super().__init__()
        self.tagger = tagger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tagger = self.tagger
        inputs = _fakes((args, kwargs))
        tags = [tagger.tag(t) for t in inputs]
        on_dev = DEVICE in tags
        host = [t for t, tag in zip(inputs, tags) if tag == HOST and t.dim() > 0]
        name = str(func)
        tagger.device_ops += on_dev
        if name.startswith(("c10d.", "_c10d_functional.")):
            if host:  # NCCL refuses host tensors (every simulated group is NCCL on a GPU)
                tagger.violation(f"{name} on host tensor {host[0].dtype}{tuple(host[0].shape)}")
            return func(*args, **kwargs)
        if on_dev and host and name not in ALLOWED_MIXED_OPS:
            tagger.violation(f"{name} mixes device tensors with host "
                             f"{host[0].dtype}{tuple(host[0].shape)}")
        out = func(*args, **kwargs)
        in_keys = {t.untyped_storage()._cdata for t in inputs}
        if on_dev:
            tag = DEVICE
        elif inputs:
            tag = HOST if HOST in tags else None
        else:  # a factory: CUDA when asked for it (backward-time factories reach only here)
            tag = DEVICE if _is_cuda(kwargs.get("device")) else None
        if tag is not None:
            for o in _fakes(out):
                if o.untyped_storage()._cdata not in in_keys:
                    tagger.mark(o, tag)
        return out
