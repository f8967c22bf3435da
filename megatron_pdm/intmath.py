"""Integer rounding, the one copy (pure: stdlib only; the bridge may import it).

`round_up(x, m)` is every "pad to a multiple" in the project: megatron's padded vocabulary
(`arch.padded_vocab_size`), sequence lengths padded for sequence/context parallelism
(`rollout_bridge/core/packing.py`, `train/warmup.py`, `train/rollout/local.py`,
`tools/verify_conversion.py`). `ceil_div(x, m)` counts the blocks of size m that cover x (FP8
tiles in `rollout_bridge/core/weights.py`).
"""

from __future__ import annotations

__all__ = ["ceil_div", "round_up"]


def ceil_div(x: int, m: int) -> int:
    """Smallest k with k * m >= x (x >= 0, m >= 1)."""
    if m < 1:
        raise ValueError(f"ceil_div: the divisor must be >= 1, got {m}")
    return -(-x // m)


def round_up(x: int, m: int) -> int:
    """Smallest multiple of m that is >= x (x >= 0, m >= 1)."""
    return ceil_div(x, m) * m
