"""FP8 rules of Transformer Engine that the driver must honour before the first forward pass.

Checked against Transformer Engine 2.20 (transformer_engine/pytorch):
- `utils.assert_dim_for_fp8_exec` (called by `module/linear.py` and `module/layernorm_linear.py`)
  raises unless the product of an FP8 GEMM input's leading dimensions is divisible by 8 (and the
  last by 16). MXFP8 quantizes in blocks of `constants.MXFP8_BLOCK_SCALING_SIZE` = 32 rows and
  the blockwise recipe in blocks of `Float8BlockQuantizer.block_len` = 128; an input that is not
  a whole number of blocks is not quantizable (`is_quantizable` in `tensor/mxfp8_tensor.py`,
  `tensor/float8_blockwise_tensor.py`) and the sequence-parallel all-gather falls back to high
  precision (`distributed.py`).
- `quantization._compute_mxfp8_support`: MXFP8 needs compute capability >= 10.0 and < 12.0;
  `_compute_fp8_block_scaling_support`: blockwise needs >= 9.0 and a torch built with
  CUDA >= 12.9; delayed/tensorwise (`_compute_fp8_support`) need >= 9.0 (8.9 with CUDA >= 12.1).

Under sequence parallelism a rank's GEMM input holds s*b/TP rows (s/CP per context-parallel
rank), so the padded sequence length must be a multiple of TP*CP*align for every micro-batch
size b >= 1 (`seq_multiple`).
"""

from __future__ import annotations

import math

# rows (product of leading dims) each recipe's FP8 GEMM input must be a multiple of
_ROW_ALIGN = {"delayed": 8, "tensorwise": 8, "mxfp8": 32, "blockwise": 128}


def row_alignment(recipe: str | None) -> int:
    """Rows an FP8 GEMM input must be a multiple of under `recipe` (1 without FP8)."""
    if recipe is None:
        return 1
    if recipe not in _ROW_ALIGN:
        raise ValueError(f"precision.fp8_recipe={recipe!r}: expected one of {sorted(_ROW_ALIGN)}")
    return _ROW_ALIGN[recipe]


def seq_multiple(*, tp: int, cp: int = 1, fp8_recipe: str | None = None) -> int:
    """The multiple every packed sequence length is padded to.

    TP (sequence parallelism splits s over TP ranks), 2*CP under context parallelism (megatron
    splits s into 2*CP chunks), times the FP8 row alignment so that s*b/(TP*CP) is aligned for
    any micro-batch size b.
    """
    if tp < 1 or cp < 1:
        raise ValueError(f"tp={tp}, cp={cp}: both must be >= 1")
    split = tp * (2 * cp if cp > 1 else 1)
    return math.lcm(split, split * row_alignment(fp8_recipe))


def check_fp8_recipe(recipe: str, capability: tuple[int, int], torch_cuda: str | None) -> None:
    """Raises RuntimeError when this GPU/torch cannot run `recipe` (TE's own support rules)."""
    row_alignment(recipe)  # validates the name
    cap = tuple(capability)
    cuda = tuple(int(x) for x in torch_cuda.split(".")[:2]) if torch_cuda else (0, 0)
    where = f"compute capability {cap[0]}.{cap[1]}, torch CUDA {torch_cuda or 'none'}"
    if recipe == "mxfp8" and not (10, 0) <= cap < (12, 0):
        raise RuntimeError(
            f"precision.fp8_recipe=mxfp8 needs a GPU of compute capability 10.x or 11.x "
            f"(Blackwell; H100/H200 are 9.0), this one has {where}. Use blockwise or tensorwise.")
    if recipe == "blockwise" and (cap < (9, 0) or cuda < (12, 9)):
        raise RuntimeError(
            f"precision.fp8_recipe=blockwise needs compute capability >= 9.0 and a torch built "
            f"with CUDA >= 12.9, got {where}. Use tensorwise or delayed.")
    if recipe in ("delayed", "tensorwise") and cap < (8, 9):
        raise RuntimeError(
            f"precision.fp8_recipe={recipe} needs compute capability >= 8.9, got {where}.")
    if recipe in ("delayed", "tensorwise") and cap < (9, 0) and cuda < (12, 1):
        raise RuntimeError(
            f"precision.fp8_recipe={recipe} on compute capability 8.9 needs torch CUDA >= 12.1, "
            f"got {where}.")


def drop_extra_state(sharded: dict) -> dict:
    """The sharded state dict without TE's `_extra_state` entries (FP8 scaling metadata).

    A converted (local-spec) checkpoint has none, and dist-checkpoint loading refuses missing
    keys; TE recreates the FP8 metadata on the first FP8 forward pass.
    """
    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state")}
