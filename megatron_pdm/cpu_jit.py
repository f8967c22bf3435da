"""megatron-core's `jit_fuser` as megatron's own no-op decorator on a machine without CUDA.

megatron-core sets `megatron.core.jit.jit_fuser = torch.compile` and decorates its fused kernels
with it at import (the bias-activation and bias-dropout fusions, the MoE router's
`_apply_expert_bias`, ...). On a machine without a GPU that costs every process that imports
megatron-core ~1.5-2 s of torch._dynamo / torch._inductor imports, and the router's function,
called on every forward, is traced by dynamo and compiled to C++ by inductor at its first call.
None of it buys anything on a CPU: the fusions are off in this project's configs there
(megatron_pdm/mcore/model.py), and the router's function adds integer token counts (or nothing,
without expert bias), so eager and compiled give the same bits.

`install()` (run by `import megatron_pdm`, beside the triton stand-in, so it is in place before
any megatron import of a process that reaches megatron through this package) puts a finder on
`sys.meta_path` for the one module `megatron.core.jit`: it runs the module as it is and then,
if `torch.cuda.is_available()` is false, calls megatron's own `disable_jit_fuser()`, so every
decorator applied afterwards is megatron's `noop_decorator`. With a GPU nothing changes. A
process that imports megatron-core before this package keeps torch.compile (it works, slower to
start). Standard library only until megatron.core.jit is imported (then torch already is).
docs/cpu-megatron.md, §2.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODULE = "megatron.core.jit"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        import torch  # jit.py imported it

        disable = getattr(module, "disable_jit_fuser", None)
        if disable is not None and not torch.cuda.is_available():
            disable()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """The finder, once, ahead of the path finders; inert if megatron.core.jit is loaded."""
    if MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
