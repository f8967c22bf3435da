"""SGLang rollouts with top-K logprobs: `SGLangEngine` (generation over one or several servers).

What: `SGLangEngine` implements `RolloutEngine` over SGLang's native API (docs/engines.md,
SGLang): `POST /generate` with `input_ids`, `return_logprob=true`, `top_logprobs_num=K`,
`return_text_in_logprobs=false`, the n samples of a prompt sent as one batched request (the prompt
repeated n times in `input_ids`, one `rid` per item). With several servers (a list of URLs:
sglang-router cannot carry this traffic, docs/engines.md) the prompts of a call are spread over
them round-robin and a retry goes to the next server. Health, identity and control are
`SGLangControl`'s (control.py), weight sync `SGLangWeightSync`'s (weights.py), both over the
transport `SGLangHTTP` (http.py); the engine holds the three parts and offers their methods.

Fault handling: asyncio + aiohttp with a semaphore bounding in-flight requests, a total timeout
per request, and retries with exponential backoff (seeded jitter) on connection errors, timeouts,
HTTP 5xx/408/429, malformed JSON, responses that fail validation and items finishing with
`finish_reason.type == "abort"` (what /pause_generation mode "abort" does to in-flight requests).
Only the failed items of a request are re-sent. Every requested (prompt, sample) pair ends exactly
once in the batch, as a sample or as a `RolloutFailure` (prompt and sample index, attempts, last
error, which names the sample index of the call, never its position inside a retry request);
`raise_on_failure=True` turns failures into an exception. Other HTTP 4xx are not retried.
The attempt loop, retry policy and HTTP status rule are the bridge's one copy
(`rollout_bridge/core/attempts.py`, shared with the vLLM client).

Sampling params: the shared guard (`engine.check_sampling_params`: no truncation, no logit
modifiers) plus what SGLang itself refuses with `--skip-tokenizer-init` or at all, so such a call
fails here before any request: `top_k=0` (sampling_params.py `verify`: "top_k must be -1 (disable)
or at least 1"), string `stop` / `stop_regex` (need a tokenizer), and keys SGLang does not know
(its JSON contract rejects unknown `sampling_params` keys). `SAMPLING_KEYS` is checked against the
installed sglang's `SamplingParams` in CI.

Top-K transports:
- "json" (default): nested `[logprob, id, null]` triples.
- "flat_b64": `return_flat_raw_output_top_logprobs` + `return_flat_raw_top_logprobs_b64`: the
  finished response carries the output top-K as base64 float32/int32 `[T, K]` arrays (sglang >=
  0.5.22, non-streaming), decoded zero-copy. Same request count and server cost as "json".
- "scoring_b64": generate with `top_logprobs_num=0`, then one prefill-only scoring request per
  prompt (input_ids = prompt + response, `max_new_tokens=0`, `logprob_start_len=len(prompt) - 1`,
  `return_flat_raw_top_logprobs(_b64)`). SGLang's prompt rows start with one null row at
  `logprob_start_len` (logprob_result_processor.py:38/66/80), so starting one position before the
  response is what makes the first response token scored. Prompt-side logprobs are
  `log_softmax` of the raw logits (logprob_processor.py:734), i.e. untempered, while the sampled
  token's logprob is tempered: the transport is therefore refused for temperatures other than 1
  (and 0, greedy, whose decode logprobs are untempered too). It costs a second prefill.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import aiohttp
import torch

from rollout_bridge.core.decode import MalformedResponseError, loads
from rollout_bridge.core.apikey import ApiKey
from rollout_bridge.core.attempts import RetryPolicy, retryable_status, run_samples
from rollout_bridge.core.engine import (
    AttemptError,
    assemble_batch,
    attribute,
    delegate,
    run_sync,
)
from rollout_bridge.sglang.parse import parse_response_object
from rollout_bridge.sglang.parse_flat import parse_scoring_response
from rollout_bridge.sglang.control import SGLangControl
from rollout_bridge.sglang.http import ROUTES, SGLangHTTP, error_message
from rollout_bridge.sglang.sampling import SAMPLING_KEYS, check_sglang_sampling_params
from rollout_bridge.sglang.weights import SGLangWeightSync
from rollout_bridge.core.types import (
    RolloutBatch,
    RolloutFailure,
    RolloutSample,
    RolloutValidationError,
)

logger = logging.getLogger(__name__)

TOPK_TRANSPORTS = ("json", "flat_b64", "scoring_b64")


class SGLangEngine:
    """`RolloutEngine` backed by one or several SGLang HTTP servers (see module docstring).

    Args:
        base_url: A server URL ("http://127.0.0.1:30000") or a list of them.
        top_logprobs: K (`top_logprobs_num`); the support has K + 1 slots.
        api_key: `ApiKey` / string sent as `Authorization: Bearer` (SGLang --api-key).
        timeout_s: Total timeout of one /generate request (connect + generate + read).
        max_retries: Retries after the first attempt of an item (attempts = max_retries + 1).
        max_concurrency: Maximum in-flight /generate requests (over all servers).
        backoff_s: First retry delay; doubles per attempt, times a seeded jitter in [0.5, 1.5).
        backoff_max_s: Cap of the retry delay.
        seed: Seed of the jitter and of the request ids.
        vocab_size: Engine vocabulary for validation (and the startup check where possible).
        expected_model_path: Startup check against /model_info's model_path.
        allow_truncated_sampling: Accept top_p < 1, top_k > 0 or min_p > 0.
        raise_on_failure: Default of `generate(raise_on_failure=...)`.
        topk_transport: "json", "flat_b64" or "scoring_b64" (module docstring).
        control_timeout_s: Timeout of control requests (health, weight updates).
        pause_mode: /pause_generation mode ("abort", "retract" or "in_place").
        check_on_start: Run `check_server()` in the constructor.

    Parts (each built here from these arguments, shared by reference):
        http: `SGLangHTTP`, the transport (server list, API key, control requests).
        control: `SGLangControl` (health, identity, versions, pause / continue).
        weights: `SGLangWeightSync` (disk, broadcast and tensor updates).
    Their public methods are the engine's own (`check_server`, `update_weights_from_disk`, ...).
    """

    def __init__(self, base_url, top_logprobs: int = 20, *, api_key: ApiKey | str | None = None,
                 timeout_s: float = 600.0, max_retries: int = 3, max_concurrency: int = 64,
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0, seed: int = 0,
                 vocab_size: int | None = None, expected_model_path: str | None = None,
                 allow_truncated_sampling: bool = False, raise_on_failure: bool = False,
                 topk_transport: str = "json", control_timeout_s: float = 600.0,
                 pause_mode: str = "abort", check_on_start: bool = False):
        if topk_transport not in TOPK_TRANSPORTS:
            raise ValueError(f"topk_transport must be one of {TOPK_TRANSPORTS}")
        self.http = SGLangHTTP(base_url, api_key=api_key, control_timeout_s=control_timeout_s)
        self.control = SGLangControl(self.http, vocab_size=vocab_size,
                                     expected_model_path=expected_model_path,
                                     pause_mode=pause_mode)
        self.weights = SGLangWeightSync(self.http, self.control)
        self.top_logprobs = int(top_logprobs)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.max_concurrency = int(max_concurrency)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.seed = int(seed)
        self.allow_truncated_sampling = allow_truncated_sampling
        self.raise_on_failure = raise_on_failure
        self.topk_transport = topk_transport
        self._rng = random.Random(seed)
        self._calls = 0
        if check_on_start:
            self.check_server()

    # ------------------------------------------------------------------ the parts' faces

    base_urls = attribute("http", "base_urls", "The servers, in order.")
    base_url = property(lambda self: self.http.base_url, doc="The first server.")
    has_api_key = property(lambda self: self.http.has_api_key)
    control_timeout_s = attribute("http", "control_timeout_s")
    vocab_size = attribute("control", "vocab_size")
    expected_model_path = attribute("control", "expected_model_path")
    pause_mode = attribute("control", "pause_mode")
    model_info = attribute("control", "model_info")

    check_server = delegate("control", SGLangControl.check_server)
    weight_versions = delegate("control", SGLangControl.weight_versions)
    weight_version = delegate("control", SGLangControl.weight_version)
    server_layout = delegate("control", SGLangControl.server_layout)
    pause_generation = delegate("control", SGLangControl.pause_generation)
    continue_generation = delegate("control", SGLangControl.continue_generation)
    begin_weight_update = delegate("control", SGLangControl.begin_weight_update)
    end_weight_update = delegate("control", SGLangControl.end_weight_update)
    flush_cache = delegate("control", SGLangControl.flush_cache)
    release_memory_occupation = delegate("control", SGLangControl.release_memory_occupation)
    resume_memory_occupation = delegate("control", SGLangControl.resume_memory_occupation)
    weight_update_session = delegate("weights", SGLangWeightSync.weight_update_session)
    update_weights_from_disk = delegate("weights", SGLangWeightSync.update_weights_from_disk)
    update_weights = delegate("weights", SGLangWeightSync.update_weights)
    init_weights_update_group = delegate("weights", SGLangWeightSync.init_weights_update_group)
    distributed_update_body = delegate("weights", SGLangWeightSync.distributed_update_body)
    post_distributed_update = delegate("weights", SGLangWeightSync.post_distributed_update)
    update_weights_from_distributed = delegate("weights",
                                               SGLangWeightSync.update_weights_from_distributed)
    destroy_weights_update_group = delegate("weights",
                                            SGLangWeightSync.destroy_weights_update_group)
    update_weights_from_tensor = delegate("weights", SGLangWeightSync.update_weights_from_tensor)

    # ------------------------------------------------------------------ payloads

    def build_generate_payload(self, prompt: list[int], num_items: int, sampling_params: dict,
                               rids: list[str], top_logprobs: int | None = None) -> dict:
        """Body of one /generate request: `num_items` repeats of one prompt."""
        k = self.top_logprobs if top_logprobs is None else top_logprobs
        payload = {"input_ids": [list(prompt) for _ in range(num_items)],
                   "sampling_params": dict(sampling_params), "rid": list(rids),
                   "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": -1,
                   "return_text_in_logprobs": False, "stream": False}
        if self.topk_transport == "flat_b64" and k > 0:
            payload.update(return_flat_raw_output_top_logprobs=True,
                           return_flat_raw_top_logprobs_b64=True)
        return payload

    def build_scoring_payload(self, prompt: list[int], responses: list[list[int]],
                              temperature: float, rids: list[str]) -> dict:
        """Body of the prefill-only scoring request for the responses of one prompt.

        `logprob_start_len = len(prompt) - 1`: SGLang's first prompt row (at logprob_start_len)
        is null, the next ones score positions len(prompt).. = the response tokens.
        """
        return {"input_ids": [list(prompt) + list(r) for r in responses],
                "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                "rid": list(rids), "return_logprob": True,
                "logprob_start_len": len(prompt) - 1,
                "top_logprobs_num": self.top_logprobs, "return_text_in_logprobs": False,
                "return_flat_raw_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True,
                "stream": False}

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                 n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt (blocking wrapper of `agenerate`)."""
        return run_sync(self.agenerate(prompt_ids, sampling_params, n,
                                       raise_on_failure=raise_on_failure))

    async def agenerate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                        n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt; every (prompt, sample) ends as sample or failure."""
        params = dict(sampling_params or {})
        if "n" in params:
            raise ValueError("pass n as generate(..., n=...), not in sampling_params")
        temperature = check_sglang_sampling_params(params, self.allow_truncated_sampling,
                                                   self.topk_transport)
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        self._calls += 1
        outcomes: dict[tuple[int, int], RolloutSample | RolloutFailure] = {}
        sem = asyncio.Semaphore(self.max_concurrency)
        connector = aiohttp.TCPConnector(limit=self.max_concurrency)
        async with aiohttp.ClientSession(connector=connector,
                                         headers=self.http.headers()) as session:
            await asyncio.gather(*(
                self._run_prompt(session, sem, p, list(prompt), params, temperature, n, outcomes)
                for p, prompt in enumerate(prompt_ids)))
        raise_on_failure = self.raise_on_failure if raise_on_failure is None else raise_on_failure
        return assemble_batch(outcomes, len(prompt_ids), n, temperature=temperature,
                              top_logprobs=self.top_logprobs, prompt_ids=prompt_ids,
                              default_version=self.control.known_version,
                              raise_on_failure=raise_on_failure, vocab_size=self.vocab_size,
                              validated=True)

    def _policy(self) -> RetryPolicy:
        return RetryPolicy(self.max_retries, self.backoff_s, self.backoff_max_s, self._rng)

    def _server(self, p: int, attempt: int) -> str:
        """Prompt p's server for its attempt: round-robin over the call's prompts, a retry on
        the next server."""
        urls = self.http.base_urls
        return urls[(p + self._calls + attempt - 1) % len(urls)]

    async def _run_prompt(self, session, sem, p: int, prompt: list[int], params: dict,
                          temperature: float, n: int, outcomes: dict) -> None:
        server: dict[int, str] = {}  # sample -> the server of its latest attempt

        async def send_round(rounds: int, pending: list[int], attempts: dict[int, int]):
            # One request for every pending sample, on the round's server.
            rids = [f"rb{self.seed}-{self._calls}-p{p}-s{j}-a{attempts[j]}" for j in pending]
            url = self._server(p, rounds)
            async with sem:
                results = await self._attempt(session, url, p, prompt, pending, params,
                                              temperature, rids)
            server.update(dict.fromkeys(pending, url))
            return zip(pending, results), url

        def stamp(j: int, sample: RolloutSample, attempts: int) -> None:
            sample.meta_info["attempts"] = attempts
            sample.meta_info["server"] = server[j]

        await run_samples(p, n, send_round, self._policy(), outcomes, stamp)

    async def _post(self, session, url: str, payload: dict) -> Any:
        """POSTs /generate; returns the decoded JSON list or raises `AttemptError`."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.post(url + ROUTES["generate"][1], json=payload,
                                    timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise AttemptError("timeout", f"{url}: no response within {self.timeout_s}s") \
                from None
        except aiohttp.ClientError as exc:
            raise AttemptError("connection", f"{url}: {type(exc).__name__}: {exc}") from None
        if status != 200:
            retryable = retryable_status(status)
            hint = " (API key missing or wrong)" if status == 401 else ""
            raise AttemptError("http", f"{url}: HTTP {status}{hint}: {error_message(raw)}",
                                retryable)
        loop = asyncio.get_running_loop()
        try:
            obj = await loop.run_in_executor(None, loads, raw)
        except MalformedResponseError as exc:
            raise AttemptError("malformed", str(exc)) from None
        n_items = len(payload["input_ids"])
        if not isinstance(obj, list) or len(obj) != n_items:
            got = len(obj) if isinstance(obj, list) else type(obj).__name__
            raise AttemptError("malformed", f"expected a list of {n_items} responses, got {got}")
        return obj

    async def _attempt(self, session, url: str, p: int, prompt: list[int], items: list[int],
                       params: dict, temperature: float, rids: list[str]) -> list:
        """One attempt for samples `items` of prompt p: a sample or an `AttemptError` each.

        Errors name the sample index j of the call (`items[i]`), never the position i inside
        this (possibly retried) request.
        """
        b64 = self.topk_transport == "scoring_b64"
        payload = self.build_generate_payload(prompt, len(items), params, rids,
                                              top_logprobs=0 if b64 else self.top_logprobs)
        try:
            objs = await self._post(session, url, payload)
        except AttemptError as exc:
            return [exc] * len(items)
        results: list = []
        for idx, obj in enumerate(objs):
            j = items[idx]
            try:
                # scoring_b64: the final support (sampled token included) is validated once, when
                # the scoring response is folded in; structural checks still run here.
                sample = parse_response_object(obj, 0 if b64 else self.top_logprobs,
                                               self.vocab_size, j, validate=not b64)
            except MalformedResponseError as exc:
                results.append(AttemptError("malformed", f"prompt {p}, {exc}"))
                continue
            except RolloutValidationError as exc:
                results.append(AttemptError("invalid", f"prompt {p}, {exc}"))
                continue
            if sample.finish_reason == "abort":
                message = (sample.meta_info.get("finish_reason_raw") or {})
                results.append(AttemptError("abort", f"prompt {p} sample {j} aborted: "
                                             f"{message}"))
                continue
            sample.meta_info["rid"] = rids[idx]
            results.append(sample)
        if b64:
            await self._score(session, url, p, prompt, items, results, temperature, rids)
        return results

    async def _score(self, session, url: str, p: int, prompt: list[int], items: list[int],
                     results: list, temperature: float, rids: list[str]) -> None:
        """Replaces the samples in `results` by scored ones (or per-item errors), in place."""
        todo = [i for i, r in enumerate(results) if isinstance(r, RolloutSample)]
        if not todo:
            return
        samples = [results[i] for i in todo]
        for s in samples:
            s.prompt_ids = torch.as_tensor(prompt, dtype=torch.int64)
        payload = self.build_scoring_payload(
            prompt, [s.response_ids.tolist() for s in samples], temperature,
            [rids[i] + "-score" for i in todo])
        start = time.perf_counter()
        try:
            objs = await self._post(session, url, payload)
        except AttemptError as exc:
            for i in todo:
                results[i] = exc
            return
        for i, o in zip(todo, objs):
            meta = o.get("meta_info") if isinstance(o, dict) else None
            got = meta.get("weight_version") if isinstance(meta, dict) else None
            want = results[i].meta_info.get("weight_version")
            if got != want:
                results[i] = AttemptError("invalid", f"prompt {p} sample {items[i]}: scoring "
                                           f"ran on weight_version {got!r}, generation on "
                                           f"{want!r}")
        # one item at a time, so an error names (and fails) only its own sample
        for i, o in zip(todo, objs):
            if not isinstance(results[i], RolloutSample):
                continue
            try:
                parse_scoring_response([o], [results[i]], self.top_logprobs, self.vocab_size,
                                       logprob_start_lens=[payload["logprob_start_len"]],
                                       sample_indices=[items[i]])
            except MalformedResponseError as exc:
                results[i] = AttemptError("malformed", f"prompt {p}, scoring: {exc}")
            except RolloutValidationError as exc:
                results[i] = AttemptError("invalid", f"prompt {p}, scoring: {exc}")
            else:
                results[i].meta_info["scoring_s"] = time.perf_counter() - start
