"""The SGLang client: HTTP transport, control, weight sync, generation and its response parsers."""
