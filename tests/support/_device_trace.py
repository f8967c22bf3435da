"""A stand-in CUDA device on a CPU-only torch: real CPU numerics, CUDA's placement rules checked.

Why: every test runs on CPU, where the driver's device (`mcore/device.py`) is the CPU itself, so
a tensor the driver forgot to move is on the right device by accident. `DeviceTrace` makes the
driver's device a *different* device again without a GPU: `torch.cuda.current_device()` returns
0 (as on a GPU), and every allocation is tagged "device" or "host" by the memory it lives in
(its storage). Computation stays on real CPU tensors (gloo collectives, checkpoints and sampling
work unchanged); what is checked is what a GPU would refuse:

- an aten op mixing a "device" tensor with a "host" tensor (other than a 0-dim host scalar,
  which CUDA accepts) -- "Expected all tensors to be on the same device";
- a collective on a host tensor over a group that is NCCL on a GPU (every group megatron or the
  driver does not create with backend="gloo"; torch's object collectives excepted: they place
  their byte tensors on the group's device themselves) -- NCCL refuses CPU tensors;
- `.numpy()` of a device tensor.

Tagging rules (the CUDA semantics, emulated):
- `device="cuda"` / an int device in a torch call, `.cuda()`, `.to(cuda)` -> "device"; the
  `.to`/`.cuda` copy gets new memory, as a real host->device copy does (so the host original
  stays "host"); `.cpu()` / `.to("cpu")` of a device tensor likewise -> new "host" memory;
- a Python-level torch call without tensor inputs (torch.tensor, torch.zeros, from_numpy, ...)
  -> "host";
- an op's new outputs -> "device" if any input is, else "host" if any input is host; views and
  in-place results keep the memory's tag (views share storage, `param.data = x` shares x's).
  A tag keeps its storage alive until no tensor uses it (then both go), so freed memory that
  torch, numpy or gloo hands to a new allocation never carries an old tag.
Allowed cross-device ops (as on CUDA): copy_, _to_copy, indexing with host indices, set_.
The backward pass runs under the same rules (torch pops a function mode while its handler runs,
so `backward`/`grad` are re-run with the mode pushed again).

Usage (in a spawned worker, after `apply_cpu_shim()`):
    with DeviceTrace() as trace: ...run the driver...
    assert not trace.violations, trace.report()
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEVICE, HOST = "device", "host"

_ALLOWED_MIXED = {
    "aten.copy_.default", "aten._to_copy.default", "aten.index.Tensor", "aten.index_put_.default",
    "aten.index_put.default", "aten._index_put_impl_.default", "aten.set_.source_Storage",
    "aten.set_.source_Storage_storage_offset", "aten.set_.source_Tensor", "aten.set_.default",
    "aten._has_compatible_shallow_copy_type.default", "aten.is_same_size.default",
    "aten.is_set_to.default",
}
_OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
                       "scatter_object_list", "all_gather_into_tensor_object"}


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _is_cpu(device) -> bool:
    """An explicit host placement: the string "cpu". A `torch.device("cpu")` object is what
    `device=t.device` passes here (every real tensor is on the CPU): "same device as t", so it
    places nothing (the allocation's tag is then unknown and never reported)."""
    return isinstance(device, str) and device.startswith("cpu")


def _tensors(obj) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _key(t: torch.Tensor) -> int | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() > 0 else None


def _where() -> str:
    """The innermost frames outside torch and this file: where the offending call was made."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if "/torch/" not in f.filename
              and not f.filename.endswith(("_device_trace.py", "cpu_shim.py"))]
    return " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                       for f in reversed(frames[-4:]))


class DeviceTrace:
    """Context manager: the stand-in device, its tags and the recorded violations."""

    def __init__(self):
        self.tags: dict[int, tuple[str, torch.UntypedStorage]] = {}  # storage address ->
        self._prune_at = 4096
        self.violations: list[str] = []
        self.device_ops = 0  # aten ops that had a device input
        self._gloo_groups: set[int] = set()
        self._fmode = _FunctionMode(self)
        self._dmode = _DispatchMode(self)

    # ------------------------------------------------------------------ tags

    def tag(self, t: torch.Tensor) -> str | None:
        k = _key(t)
        entry = None if k is None else self.tags.get(k)
        return None if entry is None else entry[0]

    def mark(self, t: torch.Tensor, tag: str | None) -> None:
        k = _key(t)
        if k is None:
            return
        if tag is None:
            self.tags.pop(k, None)
            return
        # The entry holds the storage, so its memory cannot be freed and handed to another
        # (untagged) allocation while the tag exists; `_prune` drops entries nobody else holds.
        self.tags[k] = (tag, t.untyped_storage())
        if len(self.tags) > self._prune_at:
            self._prune()

    def _prune(self) -> None:
        self.tags = {k: v for k, v in self.tags.items()
                     if torch._C._storage_Use_Count(v[1]._cdata) > 1}
        self._prune_at = max(4096, 2 * len(self.tags))

    def on_device(self, t: torch.Tensor) -> bool:
        return self.tag(t) == DEVICE

    def violation(self, what: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(f"{what} at {_where()}")

    def report(self) -> str:
        seen: dict[str, int] = {}
        for v in self.violations:
            seen[v] = seen.get(v, 0) + 1
        return "\n".join(f"{n}x {v}" for v, n in seen.items())

    # ------------------------------------------------------------------ groups

    def _is_gloo_group(self, script_pg) -> bool:
        try:
            pg = dist.ProcessGroup.unbox(script_pg)
        except Exception:  # noqa: BLE001 - not a process group
            return False
        return id(pg) in self._gloo_groups

    # ------------------------------------------------------------------ context

    def __enter__(self) -> "DeviceTrace":
        self._saved = (torch.cuda.current_device, dist.new_group)
        torch.cuda.current_device = lambda: 0  # what a GPU rank returns
        original_new_group = dist.new_group

        def new_group(*args, **kwargs):
            group = original_new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo" and group is not None:
                self._gloo_groups.add(id(group))
            return group

        dist.new_group = new_group
        self._fmode.__enter__()
        self._dmode.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._dmode.__exit__(*exc)
        self._fmode.__exit__(*exc)
        torch.cuda.current_device, dist.new_group = self._saved
        return False


_BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}


class _FunctionMode(TorchFunctionMode):
    """Python-level torch calls: device arguments, transfers, host factories, .numpy()."""

    def __init__(self, trace: DeviceTrace):
        super().__init__()
        self.trace = trace

    def _backward(self, func, args, kwargs):
        """torch runs a handler with its mode popped, but the backward pass needs the mode
        (megatron's autograd functions allocate with device=current_device() there): run
        torch.autograd's own body with the mode pushed again and its torch-function hop off."""
        import torch.autograd as autograd

        if func is torch.Tensor.backward:
            names = ("gradient", "retain_graph", "create_graph", "inputs")
            kw = dict(zip(names, args[1:]), **kwargs)
            kw["grad_tensors"] = kw.pop("gradient", None)
            func, args, kwargs = autograd.backward, args[:1], kw
        hop = autograd.has_torch_function
        autograd.has_torch_function = lambda *a: False
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            autograd.has_torch_function = hop

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        trace = self.trace
        if func in _BACKWARD:
            return self._backward(func, args, kwargs)
        target = None  # DEVICE / HOST for a placement, None otherwise
        same_as = False  # device=t.device: "wherever t is", unknown here
        if kwargs.get("device") is not None:
            if _is_cuda(kwargs["device"]):
                kwargs["device"], target = "cpu", DEVICE
            elif _is_cpu(kwargs["device"]):
                target = HOST
            else:
                same_as = True
        if func is torch.Tensor.to:
            new_args = [args[0]]
            for a in args[1:]:
                if _is_cuda(a):
                    a, target = "cpu", DEVICE
                elif _is_cpu(a):
                    target = HOST
                elif isinstance(a, torch.Tensor):
                    target = trace.tag(a) or HOST
                new_args.append(a)
            args = tuple(new_args)
        elif func is torch.Tensor.cuda:
            args, kwargs, target = args[:1], {}, DEVICE
            func = torch.Tensor.clone  # a real copy into device memory
        elif func is torch.Tensor.cpu:
            target = HOST
        elif func is torch.Tensor.numpy and trace.on_device(args[0]):
            trace.violation("numpy() of a device tensor")
        inputs = _tensors((args, kwargs))
        out = func(*args, **kwargs)
        if target is None and (inputs or same_as):
            if same_as and not inputs:
                for o in _tensors(out):
                    trace.mark(o, None)
            return out
        for o in _tensors(out):
            if target is not None and any(_key(o) == _key(i) for i in inputs) and (
                    trace.tag(o) != target):
                # a transfer is a copy into the other memory, never the same storage
                if isinstance(out, torch.Tensor) and out is o:
                    out = o = o.clone()  # keeps autograd, like a real transfer
                else:
                    o = o.detach().clone()
            trace.mark(o, target or HOST)
        return out


class _DispatchMode(TorchDispatchMode):
    """aten ops: the mixed-device check and tag propagation to new outputs."""

    def __init__(self, trace: DeviceTrace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trace = self.trace
        inputs = _tensors((args, kwargs))
        tags = [(t, trace.tag(t)) for t in inputs]
        on_dev = any(tag == DEVICE for _, tag in tags)
        host = [t for t, tag in tags if tag == HOST]
        name = str(func)
        trace.device_ops += on_dev
        if name.startswith("c10d."):
            self._check_collective(name, args, host)
        elif on_dev and name not in _ALLOWED_MIXED:
            big = [t for t in host if t.dim() > 0]
            if big:
                trace.violation(f"{name} mixes device tensors with host "
                                f"{big[0].dtype}{tuple(big[0].shape)}")
        out = func(*args, **kwargs)
        if name.startswith("c10d."):
            return out
        in_keys = {_key(t) for t in inputs}
        tag = DEVICE if on_dev else (HOST if host else None)
        for o in _tensors(out):
            if _key(o) not in in_keys:
                trace.mark(o, tag)
        return out

    def _check_collective(self, name, args, host) -> None:
        if not host or any(self.trace._is_gloo_group(a) for a in args
                           if isinstance(a, torch.ScriptObject)):
            return
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_name in _OBJECT_COLLECTIVES:
                return
            frame = frame.f_back
        self.trace.violation(f"{name} on host tensor {tuple(host[0].shape)} over an NCCL group")
