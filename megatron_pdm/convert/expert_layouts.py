"""Megatron's expert layouts of one rank's local state dict: sequential <-> grouped GEMM.

Grouped-GEMM layouts of megatron's experts (TEGroupedMLP: `experts.linear_fc1.weight{j}`; legacy
GroupedMLP: `experts.weight1 [H, E_local*2I]` whose memory GroupedMLP views as [E_local, H, 2I],
`experts.weight2 [E_local*I, H]` viewed as [E_local, I, H], i.e. transposed per-expert matrices)
are converted from and to the sequential layout (`local_experts.<j>.linear_fc1.weight`, the
canonical names of mapping.py) by `sequential_to_grouped` / `grouped_to_sequential`. The dist
checkpoint itself does not depend on the expert layout (megatron stores all three under
`mlp.experts.experts.*` with an expert axis). Name patterns: `names.py`. Pure torch.
"""

from __future__ import annotations

import torch

from megatron_pdm.convert import names

__all__ = ["grouped_to_sequential", "sequential_to_grouped"]


def sequential_to_grouped(state: dict[str, torch.Tensor], style: str) -> dict[str, torch.Tensor]:
    """SequentialMLP local names -> TEGroupedMLP (`style='te'`) or legacy GroupedMLP ('legacy').

    TE keeps one [out, in] matrix per local expert (`linear_fc1.weight{j}`); the legacy layout
    stores transposed, concatenated matrices: weight1 [H, E_local*2I], weight2 [E_local*I, H].
    """
    if style not in ("te", "legacy"):
        raise ValueError(f"style must be 'te' or 'legacy', got {style!r}")
    out, legacy = {}, {}
    for name, t in state.items():
        m = names.SEQUENTIAL_EXPERT.match(name)
        if m is None:
            out[name] = t
        elif style == "te":
            out[f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"] = t
        else:
            legacy.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
    for (prefix, fc), experts in legacy.items():
        mats = [experts[j] for j in range(len(experts))]
        if fc == "linear_fc1":  # memory = E blocks of [H, 2I]; GroupedMLP views it as [E, H, 2I]
            hidden = mats[0].shape[1]
            out[prefix + "weight1"] = torch.stack([w.t() for w in mats]).reshape(hidden, -1)
        else:
            out[prefix + "weight2"] = torch.cat([w.t() for w in mats], dim=0)
    return out


def grouped_to_sequential(
    state: dict[str, torch.Tensor], *, hidden_size: int, num_local_experts: int
) -> dict[str, torch.Tensor]:
    """Inverse of `sequential_to_grouped` (either style; detected from the names).

    The legacy layout needs `num_local_experts`: weight1 [H, E_local*2I] and weight2 [E_local*I, H]
    have the same shapes for every split of E_local*I.
    """
    out = {}
    for name, t in state.items():
        te, lg = names.TE_EXPERT.match(name), names.LEGACY_EXPERT.match(name)
        if te is not None:
            out[f"{te.group(1)}local_experts.{te.group(3)}.{te.group(2)}.weight"] = t
        elif lg is not None and lg.group(2) == "weight1":
            per = t.reshape(num_local_experts, hidden_size, -1)  # GroupedMLP's view [E, H, 2I]
            for j, w in enumerate(per):
                out[f"{lg.group(1)}local_experts.{j}.linear_fc1.weight"] = w.t().contiguous()
        elif lg is not None:
            for j, w in enumerate(t.chunk(num_local_experts, dim=0)):
                out[f"{lg.group(1)}local_experts.{j}.linear_fc2.weight"] = w.t().contiguous()
        else:
            out[name] = t
    return out
