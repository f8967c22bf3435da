"""Local ports: the one free-port helper, and torchrun's arguments for a one-machine job.

free_port: a TCP port the OS says is free on `host`, for a rendezvous that another process must
bind (the SGLang weight-sync group, the vLLM server's HTTP port). The port is free when asked;
another process may take it before it is bound (the race of this idiom: it failed a test run
with EADDRINUSE on a machine shared with other jobs). Where the binder can be handed port 0
itself, that is done instead: torchrun's one-machine launches (LOCAL_TORCHRUN below), the
converter's gloo spawn (convert/distributed.py) and the tests' (tests/support/_dist.py) bind their
rendezvous store on port 0 and hold it. Pure standard library: importing it loads no torch.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now (bind to port 0, read the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# torchrun on one machine without a chosen port: `--standalone` makes the agent bind its c10d
# rendezvous store on port 0 (the OS's choice, no free port handed on), and torch's shared agent
# store serves the workers' process group from a store also bound on port 0, so MASTER_PORT is
# whatever the OS gave (torch 2.13: elastic/rendezvous/dynamic_rendezvous.py, next_rendezvous;
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turns the sharing off and brings the free-port race back). `--local-addr 127.0.0.1`: the workers reach it
# over loopback, not through this host's FQDN (which a container may not resolve).
LOCAL_TORCHRUN = ("--standalone", "--local-addr", "127.0.0.1")
