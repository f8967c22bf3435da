"""run_gloo itself: a failing rank must fail the caller (otherwise the TP tests could not fail);
the pooled workers are reused, start clean for every call and are replaced after a failure
or when their threads pile up."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.support._dist import run_gloo, run_tool

PROBE = "PDM_TEST_POOL_PROBE"


def _fails_on_rank1(rank, world):
    assert dist.get_world_size() == world
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")


def _leaves_state(rank, world):
    os.environ[PROBE] = "left behind"
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)


def _sees_clean_state(rank, world):
    assert PROBE not in os.environ
    assert torch.get_num_threads() == 1
    assert torch.get_default_dtype() == torch.float32
    assert dist.get_world_size() == world and dist.get_rank() == rank


@pytest.mark.gloo
@pytest.mark.slow
def test_worker_exception_propagates():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        run_gloo(_fails_on_rank1, 2)


@pytest.mark.gloo
def test_the_pool_is_reused_clean_and_replaced_after_a_failure():
    first = run_tool(os.getpid, 2)  # rank 0's process id
    assert run_tool(os.getpid, 2) == first != os.getpid()
    run_gloo(_leaves_state, 2)
    run_gloo(_sees_clean_state, 2)
    with pytest.raises(RuntimeError, match="rank 1 failed on purpose"):
        run_gloo(_fails_on_rank1, 2)
    assert run_tool(os.getpid, 2) != first  # a new pool
    run_gloo(_sees_clean_state, 2)
    run_gloo(_sees_clean_state, 2, fresh=True)


def _breaks_the_reset(rank, world):
    import tests.support._dist as pool_module

    def _boom(env):
        raise RuntimeError("the reset failed on purpose")

    pool_module._reset = _boom  # in this worker only; the pool is replaced after the failure


def _holds_many_threads(rank, world):
    import threading

    from tests.support._dist import MAX_THREADS

    stop = threading.Event()
    for _ in range(MAX_THREADS + 1):
        threading.Thread(target=stop.wait, daemon=True).start()


@pytest.mark.gloo
def test_a_failed_reset_reports_its_traceback_and_a_crowded_worker_retires():
    with pytest.raises(RuntimeError, match="the reset failed on purpose"):
        run_gloo(_breaks_the_reset, 2)
    first = run_tool(os.getpid, 2)
    run_gloo(_sees_clean_state, 2)  # the new pool resets as before
    assert run_tool(os.getpid, 2) == first
    run_gloo(_holds_many_threads, 2)  # succeeds; its workers ask to retire
    second = run_tool(os.getpid, 2)
    assert second != first
    assert run_tool(os.getpid, 2) == second
