"""`gc_paused` under concurrent decodes (the client decodes responses in executor threads).

The collector flag is process-global. A pause that saves and restores it per call loses when a
second thread reads the flag while the first has it disabled and then disables it after the first
restored it: the second restores "disabled" and the process keeps running without a cyclic
collector. The interleaving is forced deterministically by a `gc` stand-in whose `isenabled`
blocks the second thread until the first has left.
"""

from __future__ import annotations

import gc
import sys
import threading

import pytest


def _module_with_gc_paused():
    from rollout_bridge.core import decode as mod
    return mod


class _GC:
    """Forwards to `gc`; `isenabled` called by the thread named "late" reads the flag, then waits
    (at most 2 s) until the thread named "early" has left its pause."""

    def __init__(self, early_left: threading.Event, late_read: threading.Event):
        self.early_left, self.late_read = early_left, late_read

    def isenabled(self):
        value = gc.isenabled()
        if threading.current_thread().name == "late":
            self.late_read.set()
            self.early_left.wait(2.0)
        return value

    def __getattr__(self, name):
        return getattr(gc, name)


@pytest.fixture
def gc_restored():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_concurrent_pauses_leave_the_collector_enabled(gc_restored, monkeypatch):
    mod = _module_with_gc_paused()
    early_in, early_left, late_read = threading.Event(), threading.Event(), threading.Event()
    monkeypatch.setattr(mod, "gc", _GC(early_left, late_read))
    errors = []

    def early():
        try:
            with mod.gc_paused():
                early_in.set()
                late_read.wait(2.0)   # the late thread has read the (disabled) flag
            early_left.set()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def late():
        try:
            early_in.wait(2.0)
            with mod.gc_paused():
                pass
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=early, name="early"),
               threading.Thread(target=late, name="late")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert gc.isenabled(), ("the cyclic GC stayed disabled after concurrent gc_paused() calls "
                            f"({mod.__name__}.gc_paused)")


def test_many_threads_nested_pauses(gc_restored):
    mod = _module_with_gc_paused()
    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        for _ in range(200):
            with mod.gc_paused():
                with mod.gc_paused():
                    assert not gc.isenabled()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert gc.isenabled()
    assert sys.getrefcount(mod) > 0
