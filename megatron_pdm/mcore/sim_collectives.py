"""Every collective of a simulated step: op, group, tensor, bytes, phase and call site.

What: `CollectiveRecorder` (a dispatch mode entered inside `fake_sim.fake_world`) records each
collective the fake process group receives. It listens where every torch.distributed entry
point ends up: the c10d ops (`c10d.allreduce_`, `c10d._allgather_base_` from
`all_gather_into_tensor`, `c10d._reduce_scatter_base_` from `_reduce_scatter_base` /
`reduce_scatter_tensor`, `c10d.alltoall_base_` from `all_to_all_single`, `c10d.broadcast_`,
`c10d.send` / `c10d.recv_` of the pipeline's p2p, ...) and funcol's `_c10d_functional.*` ops, so
no Python wrapper can be missed (megatron calls the functions, the private `_reduce_scatter_base`
and ProcessGroup methods alike). The Python-level name and the reduce op are read from the
torch.distributed frame that issued it.

Per call: the Python op (`all_reduce`, ...), the reduce op, the group (megatron's name for it:
TP, DP, EP, expert-DP, PP, ...; its size and the simulated global ranks in it), the tensors'
shapes and dtype, the buffer bytes (the larger of its tensors: the all-gathered or the
reduce-scattered whole, the all-reduced tensor), the phase (`build`, `forward`, `loss` = inside
our loss_func, `backward`, `grad reduction` = megatron's finalize_model_grads, `optimizer`) and
the call site (the innermost frame in megatron_pdm/ and the innermost outside torch).
`grouped()` sums them per (phase, op, group, shape, dtype): count and bytes per iteration.

Object collectives are stand-in 4 of fake_sim.py (no tensors reach the group) and not listed.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_pdm.mcore.sim_devices import code_location

# megatron parallel_state global -> short kind, in the order a group shared by several names
# is called (the first present wins; all names are kept in `groups`).
GROUP_KINDS = (
    ("_TENSOR_MODEL_PARALLEL_GROUP", "TP"), ("_DATA_PARALLEL_GROUP", "DP"),
    ("_DATA_PARALLEL_GROUP_WITH_CP", "DP"),  # megatron's DDP and optimizer use this one
    ("_EXPERT_MODEL_PARALLEL_GROUP", "EP"), ("_EXPERT_DATA_PARALLEL_GROUP", "expert-DP"),
    ("_PIPELINE_MODEL_PARALLEL_GROUP", "PP"), ("_EMBEDDING_GROUP", "embedding"),
    ("_POSITION_EMBEDDING_GROUP", "position-embedding"),
    ("_EXPERT_TENSOR_PARALLEL_GROUP", "expert-TP"), ("_CONTEXT_PARALLEL_GROUP", "CP"),
    ("_MODEL_PARALLEL_GROUP", "model-parallel (TP x PP)"),
    ("_TENSOR_AND_DATA_PARALLEL_GROUP", "TP x DP"),
    ("_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "TP x DP (with CP)"),
    ("_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "TP x CP"),
    ("_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "expert-TP x EP"),
    ("_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "expert-TP x EP x PP"),
    ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "partial DP"),
    ("_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP", "partial expert-DP"),
    ("_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", "all model ranks (optimizer instance)"),
)
_C10D_FILES = ("distributed_c10d.py", "_functional_collectives.py")


def _python_op() -> tuple[str, str]:
    """(the outermost torch.distributed function on the stack, its reduce op or "")."""
    name, op = "", ""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_C10D_FILES):
            name = frame.f_code.co_name
            value = frame.f_locals.get("op", frame.f_locals.get("reduceOp"))
            if isinstance(value, (dist.ReduceOp, dist.ReduceOp.RedOpType, str)):
                op = str(value).rsplit(".", 1)[-1]
        elif name:
            break
        frame = frame.f_back
    return name, op


def _group_of(args) -> "dist.ProcessGroup | None":
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue  # a ReduceOp / Work object
        if isinstance(a, str):
            try:
                return dist.distributed_c10d._resolve_process_group(a)
            except (RuntimeError, TypeError, ValueError):
                continue  # a funcol reduce-op string
    return None


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective (see module doc); `phase` is set by the simulation."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []
        self.groups: dict[str, dict] = {}  # label -> {kind, names, size, ranks}
        self._labels: dict[int, str] = {}
        self.phase = "build"
        self._override: list[str] = []

    def name_groups(self) -> None:
        """Labels for megatron's process groups (call after initialize_model_parallel)."""
        from megatron.core import parallel_state as ps

        names: dict[int, list[str]] = {}
        for attr, _kind in GROUP_KINDS:
            pg = getattr(ps, attr, None)
            if isinstance(pg, dist.ProcessGroup):
                names.setdefault(id(pg), []).append(attr.strip("_"))
        kinds = dict(GROUP_KINDS)
        for key, group_names in names.items():
            pg = next(getattr(ps, "_" + n) for n in group_names[:1])
            kind = kinds["_" + group_names[0]]
            ranks = dist.get_process_group_ranks(pg)
            label = f"{kind} {ranks}"
            self._labels[key] = label
            entry = self.groups.setdefault(label, {"kind": kind, "megatron_names": [],
                                                   "size": len(ranks), "ranks": ranks})
            entry["megatron_names"] += group_names

    def _label(self, pg) -> str:
        if pg is None:
            return "?"
        if id(pg) not in self._labels:
            ranks = dist.get_process_group_ranks(pg)
            kind = "WORLD" if pg is dist.group.WORLD else "other"
            label = f"{kind} {ranks}"
            self._labels[id(pg)] = label
            self.groups[label] = {"kind": kind, "megatron_names": [], "size": len(ranks),
                                  "ranks": ranks}
        return self._labels[id(pg)]

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        """Calls inside are of `phase` (e.g. "loss": our loss_func), backward included."""
        self._override.append(phase)
        try:
            yield
        finally:
            self._override.pop()

    def _phase(self, caller_stack: str) -> str:
        if self._override:
            return self._override[-1]
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if "finalize_model_grads" in caller_stack:
            return "grad reduction"
        return self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(("c10d.", "_c10d_functional.")) and "wait" not in name:
            self._record(name, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def _record(self, aten: str, args, kwargs) -> None:
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)]
        op, reduce_op = _python_op()
        if not op:  # funcol: the op name is the aten name's
            op = aten.split(".")[1]
            reduce_op = next((a for a in args if isinstance(a, str) and a in (
                "sum", "avg", "max", "min", "product")), "")
        project, caller = code_location()
        stack = _stack_functions()
        if op in ("isend", "irecv", "send", "recv"):  # the pipeline schedule's step it serves
            step = [f for f in stack.split() if f.startswith(("send_", "recv_"))]
            op += f" ({step[-1]})" if step else ""
        big = max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)
        self.calls.append({
            "op": op, "reduce_op": reduce_op.lower(), "c10d": aten,
            "group": self._label(_group_of(args)), "phase": self._phase(stack),
            "shapes": [list(t.shape) for t in tensors],
            "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else "",
            "bytes": big.numel() * big.element_size() if big is not None else 0,
            "project_frame": project, "caller": caller})

    def grouped(self) -> list[dict]:
        """Calls summed per (phase, op, reduce op, group, shapes, dtype), in first-call order."""
        rows: dict[tuple, dict] = {}
        for c in self.calls:
            key = (c["phase"], c["op"], c["reduce_op"], c["group"], str(c["shapes"]), c["dtype"])
            row = rows.get(key)
            if row is None:
                row = rows[key] = dict(
                    {k: c[k] for k in ("phase", "op", "reduce_op", "group", "shapes", "dtype")},
                    kind=self.groups.get(c["group"], {}).get("kind", "?"),
                    group_size=self.groups.get(c["group"], {}).get("size"),
                    count=0, bytes_per_call=c["bytes"], bytes_total=0, sites=[])
            row["count"] += 1
            row["bytes_total"] += c["bytes"]
            site = c["caller"]
            if site not in row["sites"] and len(row["sites"]) < 3:
                row["sites"].append(site)
        return list(rows.values())


def _stack_functions() -> str:
    names, frame = [], sys._getframe(2)
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return " ".join(names)
