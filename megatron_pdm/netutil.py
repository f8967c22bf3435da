"""The one free-port helper: a TCP port the OS says is free on `host`, for a rendezvous.

Used by the trainer (torchrun master port, the SGLang weight-sync group, the vLLM server), the
converter's gloo spawn, the tests and the benchmarks. The port is free when asked; another
process may take it before it is bound again (the race of this idiom: it failed a test run with
EADDRINUSE on a machine shared with other jobs). Where the binder can be handed port 0 itself,
do that instead (tests/_dist.py binds its rendezvous store on port 0 and holds it). Pure
standard library: importing it loads no torch.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now (bind to port 0, read the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
