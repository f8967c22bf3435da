"""hostinfo.cpu_model: /proc/cpuinfo's model name, and a non-empty fallback without it."""

from __future__ import annotations

import builtins

from megatron_pdm import hostinfo


def test_model_name_line_is_read(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t: x\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(
        info if p == "/proc/cpuinfo" else p, *a, **k))
    assert hostinfo.cpu_model() == "Test CPU 9000"


def test_fallback_without_proc(monkeypatch):
    def refuse(*a, **k):
        raise OSError("no /proc here")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(hostinfo.platform, "processor", lambda: "")
    monkeypatch.setattr(hostinfo.platform, "machine", lambda: "x86_64")
    assert hostinfo.cpu_model() == "x86_64"
    monkeypatch.setattr(hostinfo.platform, "machine", lambda: "")
    assert hostinfo.cpu_model() == "unknown"


def test_cpu_id_reads_the_first_processor_only(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
                    "stepping\t: 1\n\nprocessor\t: 1\ncpu family\t: 23\nmodel\t\t: 49\n"
                    "stepping\t: 0\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(
        info if p == "/proc/cpuinfo" else p, *a, **k))
    assert hostinfo.cpu_id() == "family 25 model 17 stepping 1"


def test_cpu_id_fallback_and_machine_record(monkeypatch):
    import torch

    def refuse(*a, **k):
        raise OSError("no /proc here")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(hostinfo.platform, "machine", lambda: "arm64")
    assert hostinfo.cpu_id() == "arm64"
    record = hostinfo.machine()
    assert set(record) == {"cpu_model", "cpu_id", "kernel_isa", "cpu_count"}
    assert record["kernel_isa"] == str(torch.backends.cpu.get_cpu_capability())
