"""The free-port helper: one definition (megatron_pdm/netutil.py) that everything uses."""

from __future__ import annotations

import pathlib
import re
import socket

import pytest

from megatron_pdm.netutil import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
# "bind to port 0 and read the OS's choice": the helper's body, wherever it is written again
BIND_ZERO = re.compile(r"\.bind\(\([^()]*,\s*0\)\)")


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # nothing holds it


def test_free_port_on_an_address_not_here_raises():
    with pytest.raises(OSError):
        free_port("192.0.2.1")  # TEST-NET-1: never an address of this machine


def test_no_other_free_port_helper():
    found = [f"{p.relative_to(ROOT)}:{i}"
             for top in ("megatron_pdm", "rollout_bridge", "tests", "benchmarks", "scripts")
             for p in sorted((ROOT / top).rglob("*.py")) if p.name != "netutil.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if BIND_ZERO.search(line)]
    assert found == [], f"use megatron_pdm.netutil.free_port instead of: {found}"
