"""The server engines' one attempt loop (rollout_bridge/core/attempts.py) on its own: which
answers are retried, how often, with what backoff, and that every sample ends exactly once."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rollout_bridge.core.attempts import RetryPolicy, retryable_status, run_samples
from rollout_bridge.core.engine import AttemptError
from rollout_bridge.core.types import RolloutFailure, RolloutSample


def _sample() -> RolloutSample:
    return RolloutSample(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2]),
                         behavior_logprob=torch.zeros(1), support_ids=torch.tensor([[2]],
                         dtype=torch.int32), support_logprobs=torch.zeros(1, 1),
                         support_valid=torch.ones(1, 1, dtype=torch.bool), finish_reason="stop")


@pytest.mark.parametrize("status,want", [(500, True), (503, True), (408, True), (429, True),
                                         (400, False), (401, False), (404, False), (422, False)])
def test_http_status_rule(status, want):
    assert retryable_status(status) is want


def test_backoff_doubles_up_to_the_cap_with_seeded_jitter():
    a = RetryPolicy(3, 0.5, 2.0, random.Random(7))
    b = RetryPolicy(3, 0.5, 2.0, random.Random(7))
    delays = [a.delay(k) for k in (1, 2, 3, 4)]
    assert delays == [b.delay(k) for k in (1, 2, 3, 4)]  # the same seed waits the same
    for d, base in zip(delays, (0.5, 1.0, 2.0, 2.0)):
        assert 0.5 * base <= d < 1.5 * base
    assert a.allows(3) and not a.allows(4)


def _run(script: dict[int, list], max_retries: int):
    """Runs prompt 0 with len(script) samples; script[j] = sample j's answers, one per round."""
    sent: list[list[int]] = []

    async def send_round(rounds, pending, attempts):
        sent.append(list(pending))
        assert all(attempts[j] == sum(j in s for s in sent) for j in pending)
        return [(j, script[j][attempts[j] - 1]) for j in pending], "srv"

    stamped = {}
    outcomes: dict = {}
    policy = RetryPolicy(max_retries, 0.0, 0.0, random.Random(0))
    asyncio.run(run_samples(0, len(script), send_round, policy, outcomes,
                            lambda j, s, n: stamped.setdefault(j, n)))
    return outcomes, sent, stamped


def test_retryable_errors_are_sent_again_and_every_sample_ends_once():
    ok = _sample()
    outcomes, sent, stamped = _run({
        0: [ok],
        1: [AttemptError("http", "HTTP 503"), AttemptError("timeout", "slow"), _sample()],
        2: [AttemptError("http", "HTTP 400", retryable=False)],
    }, max_retries=3)
    assert sent == [[0, 1, 2], [1], [1]]
    assert outcomes[(0, 0)] is ok and isinstance(outcomes[(0, 1)], RolloutSample)
    assert stamped == {0: 1, 1: 3}
    fail = outcomes[(0, 2)]
    assert isinstance(fail, RolloutFailure) and fail.attempts == 1 and fail.kind == "http"
    assert set(outcomes) == {(0, 0), (0, 1), (0, 2)}


def test_retries_stop_after_max_retries():
    err = AttemptError("connection", "refused")
    outcomes, sent, _ = _run({0: [err] * 5}, max_retries=2)
    assert sent == [[0], [0], [0]]  # the first attempt and 2 retries
    fail = outcomes[(0, 0)]
    assert isinstance(fail, RolloutFailure) and fail.attempts == 3 and "refused" in fail.error
