"""run_gloo itself: a failing rank must fail the caller (otherwise the TP tests could not fail);
the pooled workers are reused, start clean for every call and are replaced after a failure."""

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
