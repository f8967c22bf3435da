"""megatron-core integration: model provider, CPU shim, checkpoint helpers (imports megatron)."""
