"""Run megatron-core on a machine without a GPU (CI, laptops, the tiny CPU demo).

megatron-core assumes CUDA in a handful of places that have nothing to do with the math: it
creates `torch.cuda.Stream`s in the MoE token dispatcher, moves RoPE frequencies to
`torch.cuda.current_device()`, seeds a CUDA RNG tracker, allocates optimizer scalars with
`device='cuda'` and asserts `param.grad.type() == 'torch.cuda.FloatTensor'` in gradient clipping.
Each patch below removes exactly one of those assumptions; `docs/cpu-megatron.md` lists
the failure each one prevents (measured on megatron-core 0.16.1 and 0.19.2).

Rules:
- `apply_cpu_shim()` is a no-op when CUDA is available: the GPU path never sees these patches.
- It is idempotent and must run on every rank before the model or optimizer is built.
- Nothing here changes numerics: the patches redirect devices, make stream/event calls no-ops and
  hand split sizes to gloo as numpy arrays.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_APPLIED = False
_DEVICE_MODE: "_CudaToCpuMode | None" = None


class _FakeStream:
    """Stands in for torch.cuda.Stream/Event: every method is a no-op (CPU ops are synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self) -> bool:
        return True

    def __getattr__(self, name):
        # wait_stream, record_event, synchronize, record, ...: no-ops that chain
        # (`stream.record_event().synchronize()`).
        return lambda *args, **kwargs: _FakeStream()


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device='cuda'` (or an int device index) to CPU in every torch factory call.

    megatron-core's optimizer, grad scaler and gradient clipping allocate small scalars on
    'cuda'; without this they fail with "Torch not compiled with CUDA enabled".
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
            if func is torch.Tensor.cuda:
                return args[0]
        return func(*args, **kwargs)


def _patch_cuda_runtime() -> None:
    cuda = torch.cuda
    cuda.Stream = _FakeStream  # MoE alltoall dispatcher, DDP
    cuda.Event = _FakeStream
    cuda.current_stream = lambda *a, **k: _FakeStream()
    cuda.default_stream = lambda *a, **k: _FakeStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    # RoPE: inv_freq.to(torch.cuda.current_device()); DDP buffers.
    cuda.current_device = lambda: "cpu"
    # RNG tracker (model_parallel_cuda_manual_seed) reads/writes CUDA RNG state: use the CPU one.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda *a, **k: None
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.manual_seed = lambda *a, **k: None
    cuda.random.manual_seed = cuda.manual_seed
    cuda.empty_cache = lambda: None


def _patch_tensor_type() -> None:
    """clip_grads/optimizers compare `tensor.type()` with 'torch.cuda.FloatTensor' strings."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def _patch_megatron_modules() -> None:
    from megatron_pdm.mcore import stub_triton_paged_stash

    stub_triton_paged_stash()  # megatron-core 0.19 without triton (normally done at package import)

    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1 references these TE names even when TE is absent (NameError).
    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)

    # alltoall dispatcher: split sizes only become host lists when `tensor.is_cuda`; on CPU they
    # stay tensors and gloo's all_to_all_single rejects them.
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    try:
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    except ImportError:  # pragma: no cover - module layout changes across versions
        pass


def apply_cpu_shim() -> bool:
    """Apply the CPU patches once per process. Returns True if they are active.

    Does nothing (returns False) when CUDA is available.
    """
    global _APPLIED, _DEVICE_MODE
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    # megatron's DDP reads `.grad` of the non-leaf views our device mode hands it; the warning
    # torch raises for that is about autograd bookkeeping, not numerics (every step is tested).
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    _patch_cuda_runtime()
    _patch_tensor_type()
    _patch_megatron_modules()
    _DEVICE_MODE = _CudaToCpuMode()
    _DEVICE_MODE.__enter__()  # stays active for the life of the process
    _APPLIED = True
    logger.info("megatron-core CPU shim active (no GPU found)")
    return True
