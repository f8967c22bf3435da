"""slime (THUDM/slime) over the own-loop API: its custom loss and its rollout hooks.

* `pdm_loss` (loss.py): `--loss-type custom_loss --custom-loss-function-path
  megatron_pdm.integrations.slime.pdm_loss`.
* `generate` (hooks.py): `--custom-generate-function-path megatron_pdm.integrations.slime.generate`
  asks SGLang for the top-K and stores it on each sample.
* `convert_samples` (hooks.py): `--custom-convert-samples-to-train-data-path
  megatron_pdm.integrations.slime.convert_samples` adds `pdm_topk_ids` / `pdm_topk_logprobs` to
  slime's train data.
* `passthrough.patch`: the two key lists slime needs to carry them to the loss.

The hooks load lazily (they need the SGLang parser, `rollout_bridge.sglang`, and its orjson), so
importing the loss on the training side loads neither. docs/own-loop.md, "slime".
"""

from __future__ import annotations

from typing import Any

from megatron_pdm.integrations.slime.loss import pdm_loss

__all__ = ["convert_samples", "generate", "pdm_loss"]

_HOOKS = ("generate", "convert_samples")


def __getattr__(name: str) -> Any:
    if name in _HOOKS:   # slime's load_function: import_module, then getattr
        from megatron_pdm.integrations.slime import hooks
        return getattr(hooks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
