"""The FP8 recipe in the fake-tensor simulation: what Transformer Engine would check, and hold.

Transformer Engine is not installable on CPU and its FP8 modules do not run under fake tensors,
so the simulation of an FP8 recipe (`precision.fp8`) builds the local layer spec in the params
dtype (bf16) and adds two named, minimal stand-ins (docs/simulate.md lists them):

F1 kernels (`Fp8GemmCheck`): the local spec's `ColumnParallelLinear` / `RowParallelLinear` of
   the transformer layers stand in for TE's FP8 linears (attention qkv / proj, dense MLP fc1 /
   fc2, every expert's fc1 / fc2: the TE spec's grouped expert GEMM runs one GEMM per local
   expert on that expert's rows, the rows SequentialMLP hands to each expert here). TE keeps the
   embedding, the output layer, the router and the norms in high precision: not hooked. What can
   be checked at the real shapes is TE's shape rule on every FP8 GEMM operand (`mcore/fp8.py`):
   `assert_dim_for_fp8_exec` raises unless the product of the leading dims is divisible by 8 and
   the last dim by 16 (the module's input and its weight, forward; the gradient of its output,
   backward), and under a block recipe (blockwise: 128 rows, mxfp8: 32) an input that is not a
   whole number of row blocks is not quantizable (the sequence-parallel all-gather falls back to
   high precision). Forward pre-hooks record the inputs and weights, a hook on the output's
   gradient the backward operands. Expert inputs are checked after the padding megatron applies
   under FP8 (`SequentialMLP._pad_tensor_for_quantization`, `get_fp8_align_size`: 16 rows, 32
   for mxfp8), which the bf16 build does not run; the raw rows are reported beside it.
F2 memory (`fp8_weight_copies`): TE's FP8 copy of each of those linear weights, one byte per
   element (a uint8 tensor of the weight's shape) plus, under the blockwise recipe, one fp32
   scale per 128 x 128 block (`ceil(rows/128) x ceil(cols/128)`), allocated inside the step's
   memory tracker and held for the whole step (TE caches the cast weights across micro-batches).
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager

import torch

from megatron_pdm.intmath import ceil_div, round_up
from megatron_pdm.mcore.fp8 import row_alignment

BLOCK = 128  # the blockwise recipe's Float8BlockQuantizer.block_len (weights: 128 x 128 blocks)

NOT_SHOWN = [
    "FP8 numerics: values are placeholders; quantisation error and overflow are not simulated",
    "TE's fused FP8 kernels (cast-transpose, FP8 GEMMs, fused attention): the local spec's "
    "bf16 linears run instead",
    "TE saves FP8 (1-byte) copies of the linear inputs for backward; the local spec saves bf16 "
    "(2 bytes), so the simulated activation peak is an overestimate of that part",
    "TE's scale collectives: delayed scaling all-reduces amax histories over the amax reduction "
    "group (TP x DP, megatron's get_amax_reduction_group); the blockwise recipe keeps no amax "
    "history and computes its block scales locally; none is in the collective list",
    "whether TE also keeps a column-wise (transposed) FP8 copy of each weight for the backward "
    "GEMM: one byte per element more, not counted",
]


def fp8_layer_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every linear of the transformer layers TE would run in FP8."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and re.search(r"(^|\.)decoder\.layers\.\d+\.", n)]


def kind_of(name: str) -> str:
    """`decoder.layers.3.mlp.experts.local_experts.5.linear_fc1` -> `mlp.experts.*.linear_fc1`."""
    tail = re.sub(r"^.*?decoder\.layers\.\d+\.", "", name)
    return re.sub(r"local_experts\.\d+", "*", tail)


def rule_problems(shape, *, recipe: str, what: str) -> list[str]:
    """TE's FP8 shape rule on one GEMM operand of `shape` (empty: FP8-executable)."""
    rows, last = math.prod(shape[:-1]), shape[-1]
    out = []
    if rows % 8 or last % 16:
        out.append(f"{what} {list(shape)}: assert_dim_for_fp8_exec needs leading dims' product "
                   f"({rows}) % 8 == 0 and last dim ({last}) % 16 == 0")
    align = row_alignment(recipe)
    if what != "weight" and align > 1 and rows % align:
        out.append(f"{what} {list(shape)}: {rows} rows are not a whole number of {align}-row "
                   f"blocks ({recipe}: not quantizable, TE falls back to high precision)")
    return out


def expert_align(recipe: str) -> int:
    """Rows megatron pads each expert's input to under FP8 (`get_fp8_align_size`)."""
    from megatron.core.fp8_utils import get_fp8_align_size

    return get_fp8_align_size(recipe)


class Fp8GemmCheck:
    """Records the operand shapes of every FP8 GEMM of the layers' linears (stand-in F1)."""

    def __init__(self, model: torch.nn.Module, *, recipe: str):
        self.recipe = recipe
        self.modules = fp8_layer_linears(model)
        if not self.modules:
            raise RuntimeError("simulation (fp8): no ColumnParallelLinear / RowParallelLinear "
                               "under decoder.layers: the GEMM check would check nothing")
        self.kinds: dict[str, dict] = {}
        self.violations: dict[tuple, dict] = {}
        self._handles: list = []

    def _kind(self, name: str) -> dict:
        return self.kinds.setdefault(kind_of(name), {
            "modules": 0, "forward_calls": 0, "backward_calls": 0, "input_shapes": set(),
            "raw_input_rows": set(), "weight_shapes": set(), "grad_shapes": set()})

    def _check(self, name: str, shape, what: str) -> None:
        for problem in rule_problems(shape, recipe=self.recipe, what=what):
            v = self.violations.setdefault((name, problem), {"module": name, "problem": problem,
                                                             "count": 0})
            v["count"] += 1

    def _padded(self, name: str, shape: tuple) -> tuple:
        """An expert's operand after megatron's FP8 row padding (not run in the bf16 build)."""
        if ".local_experts." not in name:
            return shape
        a = expert_align(self.recipe)
        return (round_up(shape[0], a), *shape[1:])

    def _pre_hook(self, name: str):
        def hook(module, args):
            k = self._kind(name)
            k["forward_calls"] += 1
            shape = tuple(args[0].shape)
            k["raw_input_rows"].add(math.prod(shape[:-1]))
            shape = self._padded(name, shape)
            k["input_shapes"].add(shape)
            self._check(name, shape, "input")
            if module.weight is not None:
                k["weight_shapes"].add(tuple(module.weight.shape))
                self._check(name, tuple(module.weight.shape), "weight")

        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not (torch.is_tensor(out) and out.requires_grad):
                return  # recompute's first forward (no grad), or an evaluation pass

            def grad_hook(grad):
                k = self._kind(name)
                k["backward_calls"] += 1
                shape = self._padded(name, tuple(grad.shape))
                k["grad_shapes"].add(shape)
                self._check(name, shape, "output gradient")

            out.register_hook(grad_hook)

        return hook

    def __enter__(self):
        for name, m in self.modules:
            self._kind(name)["modules"] += 1
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(m.register_forward_hook(self._post_hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def report(self) -> dict:
        kinds = {}
        for kind, k in sorted(self.kinds.items()):
            kinds[kind] = {key: sorted(list(s) if isinstance(s, tuple) else s for s in v)
                           if isinstance(v, set) else v for key, v in k.items()}
        return {"recipe": self.recipe, "row_alignment": row_alignment(self.recipe),
                "expert_row_padding": expert_align(self.recipe), "kinds": kinds,
                "violations": sorted(self.violations.values(),
                                     key=lambda v: (v["module"], v["problem"]))}


def weight_copy_shapes(shape, recipe: str) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of TE's FP8 copy of one weight: uint8 data, blockwise fp32 scales."""
    out = [(tuple(shape), torch.uint8)]
    if recipe == "blockwise":
        rows, cols = math.prod(shape[:-1]), shape[-1]
        out.append(((ceil_div(rows, BLOCK), ceil_div(cols, BLOCK)), torch.float32))
    return out


@contextmanager
def fp8_weight_copies(model: torch.nn.Module, *, recipe: str):
    """Stand-in F2: TE's FP8 weight copies, allocated here (enter inside the memory tracker)
    and held until exit; yields {"tensors", "bytes", "weights"}."""
    held = {"tensors": [], "weights": 0}
    for _, m in fp8_layer_linears(model):
        held["weights"] += 1
        for shape, dtype in weight_copy_shapes(tuple(m.weight.shape), recipe):
            held["tensors"].append(torch.empty(shape, dtype=dtype, device=m.weight.device))
    held["bytes"] = sum(t.numel() * t.element_size() for t in held["tensors"])
    try:
        yield held
    finally:
        held["tensors"].clear()
