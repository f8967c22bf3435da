"""megatron-pdm: GRPO, DPPO, PDM and DRPO trust regions as one vocab-parallel op for Megatron-core.

Public API (never imports megatron):

    stats = token_stats(logits, sampled_ids, support_ids, support_logprobs, support_valid,
                        *, tp_group=None, vocab_size=None, temperature=1.0)   # one device
    stats = token_stats(..., tp_group=tp_group, vocab_size=engine_vocab)          # a TP shard
    cfg   = PolicyLossConfig.preset("pdm-agg")
    out   = policy_loss(stats, advantages, behavior_logprob, loss_mask, cfg, seq_ids=None)
    loss_sum, num_tokens, metrics = out

Your own forward_step (docs/own-loop.md): `fold_support` (numpy) / `fold_support_torch`,
`response_rows` + `place_on_rows` (response-aligned fields onto the logits rows that score them,
no copy of the vocab shard), `loss_on_rows`, `normalize_loss`, `check_logprob_alignment`,
`reduce_metrics`.

`tp_group` and `vocab_size` have no default: the caller always says whether the logits are a
vocab shard and how much of them is padding (None for both: one device, no padding).

The names are resolved lazily (PEP 562): `import megatron_pdm.ops` loads the math layer only, not
the parallel op or the loss. Modules inside the package import each other by module path, never
through this face (tests/repo/test_import_boundaries.py).
"""

from __future__ import annotations

import importlib

from megatron_pdm.cpu_jit import install as _cpu_jit
from megatron_pdm.triton_stub import stub_triton_paged_stash as _stub_triton

# megatron-core 0.19 without triton: before any megatron import of this process
# (megatron_pdm/triton_stub.py says why here). Inert with triton or megatron-core 0.16.
_stub_triton()
# megatron's jit_fuser (torch.compile) as its no-op decorator where there is no GPU
# (megatron_pdm/cpu_jit.py). Inert with a GPU.
_cpu_jit()

_EXPORTS = {
    "PRESETS": "megatron_pdm.config",
    "PolicyLossConfig": "megatron_pdm.config",
    "PolicyLossOutput": "megatron_pdm.loss.policy_loss",
    "policy_loss": "megatron_pdm.loss.policy_loss",
    "TokenStats": "megatron_pdm.ops.stats",
    "token_stats": "megatron_pdm.parallel.vocab_parallel",
    # your own forward_step (docs/own-loop.md)
    "SupportError": "megatron_pdm.ops.support",
    "check_support": "megatron_pdm.ops.support",
    "fold_support": "megatron_pdm.ops.support",
    "fold_support_torch": "megatron_pdm.ops.support_torch",
    "reduce_metrics": "megatron_pdm.metrics",
    "Rows": "megatron_pdm.own_loop",
    "PlacedRows": "megatron_pdm.own_loop",
    "response_rows": "megatron_pdm.own_loop",
    "place_on_rows": "megatron_pdm.own_loop",
    "loss_on_rows": "megatron_pdm.own_loop",
    "normalize_loss": "megatron_pdm.own_loop",
    "check_logprob_alignment": "megatron_pdm.own_loop",
    "auto_inplace": "megatron_pdm.own_loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_pdm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
