"""Megatron's parameter-name patterns, the one table (`mapping.py` and `sharding.py` read it).

Canonical names (mapping.py) are those of a TP=1, EP=1, PP=1 GPTModel of the local spec:
`decoder.layers.<L>.<rest>` with sequential experts `mlp.experts.local_experts.<e>.<fc>.weight`.
A rank's own state dict uses the same shapes of name with local layer / expert indices, and the
grouped-GEMM specs name their experts differently (TEGroupedMLP `mlp.experts.linear_fc1.weight<j>`,
legacy GroupedMLP `mlp.experts.weight1` / `weight2`).

    LAYER             decoder.layers.<L>.<rest>                   groups: L, rest
    LOCAL_EXPERT      mlp.experts.local_experts.<e>.<tail>        groups: e, tail (a layer's rest)
    EXPERT_WEIGHT     mlp.experts.local_experts.<e>.<fc>.weight   groups: e, fc (a layer's rest)
    SEQUENTIAL_EXPERT <prefix>mlp.experts.local_experts.<e>.<fc>.weight  groups: prefix, e, fc
    TE_EXPERT         <prefix>mlp.experts.<fc>.weight<j>          groups: prefix, fc, j
    LEGACY_EXPERT     <prefix>mlp.experts.weight1|weight2         groups: prefix, which

`<prefix>` is empty or ends with "." and includes "mlp.experts."; `<fc>` is linear_fc1 or
linear_fc2. Pure (no torch).
"""

from __future__ import annotations

import re

__all__ = ["EXPERT_WEIGHT", "LAYER", "LEGACY_EXPERT", "LOCAL_EXPERT", "SEQUENTIAL_EXPERT",
           "TE_EXPERT", "expert_weight", "layer_prefix"]

_FC = r"(linear_fc1|linear_fc2)"
_PREFIX = r"((?:.*\.)?mlp\.experts\.)"

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
EXPERT_WEIGHT = re.compile(rf"^mlp\.experts\.local_experts\.(\d+)\.{_FC}\.weight$")
SEQUENTIAL_EXPERT = re.compile(rf"^{_PREFIX}local_experts\.(\d+)\.{_FC}\.weight$")
TE_EXPERT = re.compile(rf"^{_PREFIX}{_FC}\.weight(\d+)$")
LEGACY_EXPERT = re.compile(rf"^{_PREFIX}(weight1|weight2)$")


def layer_prefix(layer: int) -> str:
    """`decoder.layers.<layer>.`, the start of every per-layer name."""
    return f"decoder.layers.{layer}."


def expert_weight(expert: int, fc: str) -> str:
    """A layer's rest for one sequential expert's weight: `mlp.experts.local_experts.<e>.<fc>.weight`."""
    return f"mlp.experts.local_experts.{expert}.{fc}.weight"
