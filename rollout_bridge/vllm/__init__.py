"""The vLLM client: HTTP transport, weight sync, generation, its parser and the worker extension."""
