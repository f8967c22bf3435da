"""The killed-server fault test's acceptance rule (tests/support/vllm_failure.py), on the failures a
kill can produce: every clear one passes whichever call it hit, unclear ones are refused."""

from __future__ import annotations

import pytest

from tests.support.vllm_failure import check_no_lost_or_duplicated_sample, clear_server_failure

URL = "http://127.0.0.1:41234"
PREFIX = "RuntimeError: rollout server call failed on rank 0: "
CLEAR = [
    # the kill lands during the weight-version check after the rollouts
    "EngineMismatchError: http://127.0.0.1:41234: weight version check after the rollouts failed "
    "(GET /weight_info: ClientOSError: [Errno 104] Connection reset by peer); the samples cannot "
    "be attributed to a version",
    "RolloutFailedError: 3 rollout(s) failed: prompt 0/1 (POST /v1/completions: "
    "ClientConnectorError: Cannot connect to host 127.0.0.1:41234)",
    "WeightSyncError: vLLM weight push of version 3 failed: POST /pause: ServerDisconnectedError: "
    "Server disconnected",
    "EngineMismatchError: http://127.0.0.1:41234 is not healthy: GET /health: ClientConnectorError",
    # the kill lands on the pause that frames a weight push
    "WeightSyncError: vLLM server http://127.0.0.1:41234: pause before the weight push failed: "
    "POST /pause: ServerDisconnectedError: Server disconnected",
    "RolloutFailedError: 32 rollout(s) failed: prompt 0/0 (http://127.0.0.1:41234 is unreachable "
    "(health check failed))",
]


@pytest.mark.parametrize("message", CLEAR)
def test_every_clear_failure_is_accepted(message):
    log = "...\n[rank0] " + PREFIX + message + "\n"
    assert clear_server_failure(log, URL) == message


@pytest.mark.parametrize("log, why", [
    ("Traceback ...\nRuntimeError: boom\n", "no 'rollout server call failed"),
    (PREFIX + "KeyError: 'choices'\n", "does not name the server"),
    (PREFIX + "RuntimeError: vLLM said no\n", "does not name the call"),
])
def test_unclear_failures_are_refused(log, why):
    with pytest.raises(AssertionError, match=why):
        clear_server_failure(log, URL)


def _rows(iterations):
    return [{"iteration": i, "minibatch": m, "rollout/num_samples": 32}
            for i in range(iterations) for m in range(2)]


def test_sample_bookkeeping():
    check_no_lost_or_duplicated_sample(_rows(2), samples=32, minibatches=2, iterations=6)
    with pytest.raises(AssertionError):  # a partial batch trained
        check_no_lost_or_duplicated_sample(_rows(2)[:-1] + [dict(_rows(2)[-1], **{
            "rollout/num_samples": 31})], samples=32, minibatches=2, iterations=6)
    with pytest.raises(AssertionError):  # an iteration trained twice
        check_no_lost_or_duplicated_sample(_rows(2) + _rows(2)[-2:], samples=32, minibatches=2,
                                           iterations=6)
    with pytest.raises(AssertionError, match="did not stop"):
        check_no_lost_or_duplicated_sample(_rows(6), samples=32, minibatches=2, iterations=6)
