"""Loss layer. `policy_loss` is torch-only; the Megatron adapter (`megatron_hook`) is imported
lazily by attribute access so that `import megatron_pdm.loss` never imports megatron."""

from megatron_pdm.loss.policy_loss import PolicyLossOutput, policy_loss

__all__ = ["PolicyLossOutput", "policy_loss"]


def __getattr__(name: str):
    if name == "megatron_hook":
        import importlib

        return importlib.import_module("megatron_pdm.loss.megatron_hook")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
