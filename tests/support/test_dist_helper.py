"""run_gloo itself: a failing rank must fail the caller (otherwise the TP tests could not fail)."""

import pytest
import torch.distributed as dist

from tests.support._dist import run_gloo


def _fails_on_rank1(rank, world):
    assert dist.get_world_size() == world
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")


@pytest.mark.gloo
@pytest.mark.slow
def test_worker_exception_propagates():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        run_gloo(_fails_on_rank1, 2)
