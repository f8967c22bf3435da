"""The local shape every parameter of the GPTModel must have at a layout, from the arch alone.

What: `expected_param_shape(name, arch, tp=, ep=)` is the shape of parameter `name` on one rank
(TP shards of attention and vocabulary, EP shards of the experts, replicated norms and router),
derived from `ModelArch` and megatron's sharding rules, not from megatron's code; and
`check_param_shapes(model, arch, tp=, ep=)` lists every parameter whose built shape differs
(and every name it has no rule for). The simulation (train/simulate.py) calls it on the model
built at the real recipe's shapes; the vocabulary shard follows the one padding rule
(`ModelArch.padded_vocab(tp) // tp`: 151,936 -> 152,064 rows, 38,016 per TP-4 rank).
"""

from __future__ import annotations

import re

from megatron_pdm.arch import ModelArch


def expected_param_shape(name: str, arch: ModelArch, *, tp: int, ep: int) -> tuple[int, ...] | None:
    """Local shape of parameter `name` (megatron GPTModel naming), or None for an unknown name."""
    h, d = arch.hidden_size, arch.head_dim
    nh, g = arch.num_attention_heads, arch.num_query_groups
    v_local = arch.padded_vocab(tp) // tp
    ffn = arch.mlp_width  # a dense model's MLP width (unused by a MoE model)
    rules = [
        (r"embedding\.word_embeddings\.weight$", (v_local, h)),
        (r"output_layer\.weight$", (v_local, h)),
        (r"self_attention\.linear_qkv\.weight$", ((nh + 2 * g) * d // tp, h)),
        (r"self_attention\.linear_proj\.weight$", (h, nh * d // tp)),
        (r"self_attention\.(q|k)_layernorm\.weight$", (d,)),
        (r"(input_layernorm|pre_mlp_layernorm|final_layernorm)\.weight$", (h,)),
        (r"mlp\.router\.weight$", (arch.num_experts, h)),
        (r"experts\.local_experts\.\d+\.linear_fc1\.weight$", (2 * arch.moe_ffn_hidden_size, h)),
        (r"experts\.local_experts\.\d+\.linear_fc2\.weight$", (h, arch.moe_ffn_hidden_size)),
        (r"mlp\.linear_fc1\.weight$", (2 * ffn // tp, h)),
        (r"mlp\.linear_fc2\.weight$", (h, ffn // tp)),
    ]
    for pattern, shape in rules:
        if re.search(pattern, name):
            return shape
    return None


def check_param_shapes(model, arch: ModelArch, *, tp: int, ep: int) -> list[str]:
    """Every mismatch between the built parameters and `expected_param_shape` (empty: all match).

    Also checks the number of local experts per layer (num_experts / EP).
    """
    problems = []
    experts: dict[str, set[int]] = {}
    for name, p in model.named_parameters():
        want = expected_param_shape(name, arch, tp=tp, ep=ep)
        if want is None:
            problems.append(f"{name}: no shape rule (unexpected parameter)")
        elif tuple(p.shape) != want:
            problems.append(f"{name}: built {tuple(p.shape)}, expected {want}")
        m = re.search(r"^(.*experts)\.local_experts\.(\d+)\.", name)
        if m:
            experts.setdefault(m.group(1), set()).add(int(m.group(2)))
    if arch.num_experts:
        for layer, idx in sorted(experts.items()):
            if len(idx) != arch.num_experts // ep:
                problems.append(f"{layer}: {len(idx)} local experts, expected "
                                f"{arch.num_experts // ep} (num_experts / EP)")
    return problems
