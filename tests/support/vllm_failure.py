"""What a clear failure of a trainer run against a dead rollout server looks like.

A server killed for good can fail the run at several moments (a rollout request, the health
check of the restart guard, the weight-version check after the rollouts, the weight push); each
gives a different, correct error. The fault tests accept all of them and check what matters
instead of one phrasing: the error is the driver's "rollout server call failed on rank 0", it
names the server (its host:port, or "vLLM") and the call that failed (an HTTP method and path,
the health check, or the weight push).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

ERROR_LINE = re.compile(r"rollout server call failed on rank 0: (\w+): (.*)")
# `GET /weight_info`, `POST /v1/completions`, `POST /pause`, ...
HTTP_CALL = re.compile(r"\b(GET|POST) /\w")
CALL_WORDS = ("health check", "not healthy", "weight push")


def clear_server_failure(text: str, url: str) -> str:
    """The driver's error message (`Type: message`) in a trainer log; AssertionError naming
    what is missing when the log has no such error or it does not name the server and the call."""
    found = ERROR_LINE.findall(text)
    if not found:
        raise AssertionError("no 'rollout server call failed on rank 0' error in the log:\n"
                             + text[-4000:])
    kind, message = found[-1]
    netloc = urlsplit(url).netloc
    if not (netloc in message or "vLLM" in message):
        raise AssertionError(f"the error does not name the server ({netloc} or vLLM): "
                             f"{kind}: {message}")
    if not (HTTP_CALL.search(message) or any(w in message for w in CALL_WORDS)):
        raise AssertionError(f"the error does not name the call that failed: {kind}: {message}")
    return f"{kind}: {message}"


def check_no_lost_or_duplicated_sample(metrics: list[dict], *, samples: int,
                                       minibatches: int, iterations: int) -> None:
    """Every logged iteration trained on the full batch, once, and the run stopped early."""
    per_iteration: dict[int, list[int]] = {}
    for r in metrics:
        per_iteration.setdefault(r["iteration"], []).append(r["minibatch"])
        assert r["rollout/num_samples"] == samples, r
    logged = sorted(per_iteration)
    assert logged == list(range(len(logged))), f"iterations logged: {logged}"
    assert len(logged) < iterations, "the run did not stop"
    for it, mbs in per_iteration.items():
        assert sorted(mbs) == list(range(minibatches)), f"iteration {it}: minibatches {mbs}"
