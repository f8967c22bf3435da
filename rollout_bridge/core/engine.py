"""The `RolloutEngine` protocol and helpers shared by its implementations.

What: the interface the trainer codes against (docs/design.md, "Rollout engine contract"), the
sampling-parameter check that keeps returned logprobs equal to the sampling distribution, and the
bookkeeping that turns per-(prompt, sample) outcomes into a `RolloutBatch` in which every requested
sample appears exactly once (as a sample or as a failure).

Why: both engines must refuse the same truncated-sampling settings and produce batches with the
same ordering and versioning rules, so the trainer cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, runtime_checkable

import torch

from rollout_bridge.core.types import (
    RolloutBatch,
    RolloutFailedError,
    RolloutFailure,
    RolloutSample,
    SamplingParamsError,
)

logger = logging.getLogger(__name__)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine.

    Attributes:
        vocab_size: The engine's real vocabulary (ids >= vocab_size never occur).
        top_logprobs: K of the returned support (S = K + 1).
    """

    vocab_size: int | None
    top_logprobs: int

    def generate(self, prompt_ids: list[list[int]], sampling_params: dict,
                 n: int = 1) -> RolloutBatch:
        """Samples `n` responses per prompt; see `RolloutBatch` for the guarantees."""
        ...

    def update_weights(self, *args: Any, **kwargs: Any) -> str:
        """Loads new policy weights; returns the new weight version."""
        ...

    def weight_version(self) -> str:
        """Current weight version of the engine."""
        ...


class AttemptError(Exception):
    """One failed HTTP attempt of a server engine (kind: timeout, connection, http, malformed,
    abort, invalid); `retryable` says whether the retry loop may send it again."""

    def __init__(self, kind: str, message: str, retryable: bool = True):
        super().__init__(message)
        self.kind, self.retryable = kind, retryable


def run_sync(coro: Coroutine) -> Any:
    """Runs a coroutine to completion, also when called from inside a running event loop (then in
    a helper thread with its own loop). Shared by the HTTP engines' synchronous entry points."""
    try:
        asyncio.get_running_loop()
        in_loop = True
    except RuntimeError:
        in_loop = False
    if not in_loop:  # (outside the except block: no chained "no running event loop" context)
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def delegate(part: str, method: Callable) -> Callable:
    """An engine method that calls `method` (same name, signature and docstring) on the engine's
    part `self.<part>`: how an engine client that holds its transport, control and weight-sync
    parts as attributes offers their public methods as its own."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return call


def attribute(part: str, name: str, doc: str | None = None) -> property:
    """An engine attribute that reads and writes `self.<part>.<name>` (see `delegate`)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


# Sampling params that change the logits before sampling (penalties, logit bias, grammar masks,
# forced minimum length, custom processors, watermarks): with any of them the engine's returned
# logprobs are those of the modified distribution, which the trainer cannot reproduce from the
# policy logits, so the behaviour policy is not the policy's tempered softmax. SGLang applies them
# in `SamplingBatchInfo.apply_logits_bias` before the sampler (sampling_batch_info.py:426-449,
# model_runner.py:2093 (0.5.23)); "min_tokens" is vLLM's name for min_new_tokens. Neutral values
# (0, 1.0, None, empty) are accepted.
LOGIT_MODIFIERS: dict[str, object] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "min_tokens": 0, "logit_bias": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "custom_params": None,
    "custom_logit_processor": None, "watermark": None, "beam_width": None,
}


def _is_neutral(value, neutral) -> bool:
    if value is None or (isinstance(value, (dict, list, str)) and not value):
        return True
    if isinstance(neutral, float):
        return float(value) == neutral
    if isinstance(neutral, int):
        return int(value) == neutral
    return False


def check_sampling_params(params: dict, allow_truncated_sampling: bool = False) -> float:
    """Refuses sampling settings under which returned logprobs are not the sampling policy.

    SGLang (and `LocalEngine`) return `log_softmax(logits / temperature)` before top-k / top-p /
    min-p truncation, so with truncation the true behavior policy is the truncated, renormalized
    distribution and the returned top-K is wrong for it (docs/engines.md, SGLang). Penalties,
    logit bias, grammars, min_new_tokens, custom logit processors and watermarks (`LOGIT_MODIFIERS`)
    are refused always: they make the behaviour distribution something the policy's logits do not
    give.

    Args:
        params: SGLang-style sampling params.
        allow_truncated_sampling: Accept top-p / top-k / min-p truncation anyway (the caller
            handles the mismatch); never accepts the logit modifiers.

    Returns:
        The temperature (default 1.0).

    Raises:
        SamplingParamsError: On a logit modifier with a non-neutral value, a negative or
            non-finite temperature, or (unless allowed) top_p < 1, top_k not in (-1, None, 0),
            min_p > 0.
    """
    temperature = float(params.get("temperature", 1.0))
    if not temperature >= 0 or temperature == float("inf"):
        raise SamplingParamsError(f"temperature must be finite and >= 0, got {temperature}")
    modified = [f"{k}={params[k]!r}" for k, neutral in LOGIT_MODIFIERS.items()
                if k in params and not _is_neutral(params[k], neutral)]
    if modified:
        raise SamplingParamsError(
            "sampling params " + ", ".join(modified) + " change the logits before sampling: the "
            "returned logprobs would be those of a distribution the policy does not give")
    problems = []
    top_p = params.get("top_p", 1.0)
    if top_p is not None and float(top_p) < 1.0:
        problems.append(f"top_p={top_p} < 1")
    top_k = params.get("top_k", -1)
    if top_k is not None and int(top_k) not in (-1, 0) and int(top_k) < (1 << 30):
        problems.append(f"top_k={top_k} != -1")
    min_p = params.get("min_p", 0.0)
    if min_p is not None and float(min_p) > 0.0:
        problems.append(f"min_p={min_p} > 0")
    if problems and not allow_truncated_sampling:
        raise SamplingParamsError(
            "truncated sampling (" + ", ".join(problems) + ") makes the returned logprobs "
            "differ from the sampling distribution; use top_p=1, top_k=-1, min_p=0 or pass "
            "allow_truncated_sampling=True")
    if problems:
        logger.warning("truncated sampling allowed (%s): behavior logprobs are untruncated",
                       ", ".join(problems))
    return temperature


def assemble_batch(outcomes: dict[tuple[int, int], RolloutSample | RolloutFailure],
                   num_prompts: int, n: int, *, temperature: float, top_logprobs: int,
                   prompt_ids: list[list[int]], default_version: str | None,
                   raise_on_failure: bool = False, vocab_size: int | None = None,
                   validated: bool = False) -> RolloutBatch:
    """Builds a `RolloutBatch` from one outcome per (prompt_index, sample_index).

    Args:
        outcomes: Exactly one entry per requested pair.
        num_prompts, n: The request shape.
        temperature, top_logprobs: Recorded on the batch.
        prompt_ids: Prompts, copied into each sample.
        default_version: Version used for samples lacking `meta_info["weight_version"]`.
        raise_on_failure: Raise `RolloutFailedError` if any failure is present.
        vocab_size: The engine's vocabulary, recorded on the batch.
        validated: Whether every sample's support was checked when parsed/produced.

    Returns:
        The batch; samples and failures ordered by (prompt_index, sample_index).
    """
    expected = {(p, j) for p in range(num_prompts) for j in range(n)}
    if set(outcomes) != expected:
        missing = sorted(expected - set(outcomes))[:5]
        extra = sorted(set(outcomes) - expected)[:5]
        raise AssertionError(f"rollout bookkeeping bug: missing {missing}, unexpected {extra}")
    samples, failures = [], []
    for key in sorted(outcomes):
        out = outcomes[key]
        if isinstance(out, RolloutFailure):
            failures.append(out)
            continue
        out.prompt_index, out.sample_index = key
        out.group_index = key[0]
        out.prompt_ids = torch.as_tensor(prompt_ids[key[0]], dtype=torch.int64)
        if out.meta_info.get("weight_version") is None:
            out.meta_info["weight_version"] = default_version
        samples.append(out)
    versions = sorted({str(s.meta_info["weight_version"]) for s in samples
                       if s.meta_info["weight_version"] is not None})
    if not samples:
        version = default_version
    elif len(versions) == 1 and all(s.meta_info["weight_version"] is not None for s in samples):
        version = versions[0]
    else:
        version = ",".join(versions) if versions else None
        logger.warning("rollout batch mixes weight versions %s", versions)
    if failures:
        logger.warning("%d of %d requested samples failed", len(failures), num_prompts * n)
    batch = RolloutBatch(samples=samples, temperature=temperature, weight_version=version,
                         top_logprobs=top_logprobs, failures=failures, n=n,
                         num_prompts=num_prompts, vocab_size=vocab_size, validated=validated)
    if raise_on_failure and failures:
        raise RolloutFailedError(failures)
    return batch
