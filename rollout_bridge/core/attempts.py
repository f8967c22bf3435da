"""The server engines' attempt loop: one retry policy, the per-sample loop, the HTTP status rule.

Both HTTP clients (`sglang/client.py`, `vllm/client.py`) run every prompt through
`run_samples`: each round sends the prompt's pending samples (how, is the engine's: one request
to one server for SGLang, an n-request then one request per sample for vLLM), and each sample's
answer is a `RolloutSample` (done), a retryable `AttemptError` with attempts left (sent again
after the policy's backoff) or any other error (a `RolloutFailure` naming prompt, sample,
attempts and the last error). Every (prompt, sample) ends exactly once in `outcomes`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rollout_bridge.core.types import RolloutFailure, RolloutSample

logger = logging.getLogger(__name__)

__all__ = ["RetryPolicy", "retryable_status", "run_samples"]


def retryable_status(status: int) -> bool:
    """An HTTP answer worth sending again: a server error (5xx), a timeout (408) or a rate limit
    (429); every other 4xx is the request's own fault and is not retried."""
    return status >= 500 or status in (408, 429)


@dataclass
class RetryPolicy:
    """Retries after the first attempt (`max_retries`), exponential backoff from `backoff_s`
    (doubling per attempt, capped at `backoff_max_s`) times a seeded jitter in [0.5, 1.5) drawn
    from `rng` (the engine's, so a seeded engine waits reproducibly)."""

    max_retries: int
    backoff_s: float
    backoff_max_s: float
    rng: random.Random

    def allows(self, attempts: int) -> bool:
        """Whether a sample that has had `attempts` attempts may have another."""
        return attempts <= self.max_retries

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` + 1."""
        base = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (0.5 + self.rng.random())


Round = Callable[[int, list[int], dict[int, int]],
                 Awaitable[tuple[Iterable[tuple[int, Any]], str | None]]]


async def run_samples(p: int, n: int, send_round: Round, policy: RetryPolicy, outcomes: dict,
                      stamp: Callable[[int, RolloutSample, int], None]) -> None:
    """Samples 0..n-1 of prompt p until each is a sample or a failure in `outcomes[(p, j)]`.

    `send_round(round, pending, attempts)` (round counts from 1; `attempts[j]` already counts
    this round's attempt) returns ((j, RolloutSample | AttemptError) per pending sample, where)
    with `where` the server asked, named in the retry log (None: not named).
    `stamp(j, sample, attempts)` records the engine's facts on a finished sample (its attempts,
    seed, server).
    """
    pending = list(range(n))
    attempts = dict.fromkeys(pending, 0)
    rounds = 0
    while pending:
        rounds += 1
        for j in pending:
            attempts[j] += 1
        answers, where = await send_round(rounds, pending, attempts)
        on = f" on {where}" if where else ""
        retry = []
        for j, res in answers:
            key = (p, j)
            if key in outcomes:
                raise AssertionError(f"duplicate outcome for prompt {p} sample {j}")
            if isinstance(res, RolloutSample):
                stamp(j, res, attempts[j])
                outcomes[key] = res
            elif res.retryable and policy.allows(attempts[j]):
                logger.info("prompt %d sample %d attempt %d failed%s (%s): %s; retrying",
                            p, j, attempts[j], on, res.kind, res)
                retry.append(j)
            else:
                logger.warning("prompt %d sample %d failed after %d attempt(s) (%s): %s", p, j,
                               attempts[j], res.kind, res)
                outcomes[key] = RolloutFailure(p, j, attempts[j], str(res), res.kind)
        if retry:
            await asyncio.sleep(policy.delay(max(attempts[j] for j in retry)))
        pending = sorted(retry)
