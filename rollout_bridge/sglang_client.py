"""HTTP client for a running SGLang server (or router): rollouts with top-K and weight sync.

What: `SGLangEngine` implements `RolloutEngine` over SGLang's native API (docs/engines.md, SGLang,
§4.4): `POST /generate` with `input_ids`, `return_logprob=true`, `top_logprobs_num=K`,
`return_text_in_logprobs=false`, the n samples of a prompt sent as one batched request (the
prompt repeated n times in `input_ids`, one `rid` per item); startup checks (`/health`,
`/get_model_info`, `/get_weight_version`); weight sync `pause_generation ->
update_weights_from_disk -> continue_generation`.

Fault handling: asyncio + aiohttp with a semaphore bounding in-flight requests, a total timeout
per request, and retries with exponential backoff (seeded jitter) on connection errors, timeouts,
HTTP 5xx/408/429, malformed JSON, responses that fail validation and items finishing with
`finish_reason.type == "abort"`. Only the failed items of a request are re-sent. Every requested
(prompt, sample) pair ends exactly once in the batch, as a sample or as a `RolloutFailure`
(prompt index, attempts, last error); `raise_on_failure=True` turns failures into an exception.
Other HTTP 4xx are not retried (the request itself is wrong).

Binary top-K transports (opt-in; "json" = the nested triples is the default):
- `topk_transport="flat_b64"`: one /generate request with `top_logprobs_num=K`,
  `return_flat_raw_output_top_logprobs=true` and `return_flat_raw_top_logprobs_b64=true`: the
  finished response carries the output top-K as base64 float32/int32 `[T, K]` arrays
  (`output_top_logprobs_{val,idx}_flat_b64`, SGLang >= 0.5.2x, non-streaming only), decoded
  zero-copy. No extra cost on the server; only the sampled-token list stays nested JSON.
- `topk_transport="scoring_b64"` (for servers without the output-side flat format): generate with
  `top_logprobs_num=0` (sampled logprobs only, small JSON), then one scoring request per prompt
  (input_ids = prompt + response, `max_new_tokens=0`, `logprob_start_len=len(prompt)`,
  `top_logprobs_num=K`, `return_flat_raw_top_logprobs=true`,
  `return_flat_raw_top_logprobs_b64=true`) decoded zero-copy. Cost: a second prefill over
prompt + response per sample (about one forward of the sequence; no decode), in exchange for
~4x less payload and no JSON triple decoding. Top-K then comes from prefill numerics while the
sampled logprob is the decode one (they agree to ~1e-6 in fp32 per miles #2722; bf16/FP8 engines
differ more). The scoring must run before the next weight update; the client checks that the
scoring response's weight_version equals the generation's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import torch

from rollout_bridge.engine import assemble_batch, check_sampling_params
from rollout_bridge.decode import MalformedResponseError, loads
from rollout_bridge.parse import parse_response_object
from rollout_bridge.parse_flat import parse_scoring_response
from rollout_bridge.types import (
    EngineMismatchError,
    RolloutBatch,
    RolloutFailure,
    RolloutSample,
    RolloutValidationError,
    WeightSyncError,
)

logger = logging.getLogger(__name__)

TOPK_TRANSPORTS = ("json", "flat_b64", "scoring_b64")


class _AttemptError(Exception):
    def __init__(self, kind: str, message: str, retryable: bool = True):
        super().__init__(message)
        self.kind, self.retryable = kind, retryable


def _run_sync(coro: Coroutine) -> Any:
    """Runs a coroutine to completion, also when called from inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict[str, Any] = {}

    def target():
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class SGLangEngine:
    """`RolloutEngine` backed by an SGLang HTTP server (see module docstring).

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        top_logprobs: K (`top_logprobs_num`); the support has K + 1 slots.
        timeout_s: Total timeout of one /generate request (connect + generate + read).
        max_retries: Retries after the first attempt of an item (attempts = max_retries + 1).
        max_concurrency: Maximum in-flight /generate requests.
        backoff_s: First retry delay; doubles per attempt, times a seeded jitter in [0.5, 1.5).
        backoff_max_s: Cap of the retry delay.
        seed: Seed of the jitter and of the request ids.
        vocab_size: Engine vocabulary for validation and the startup check (None: unchecked).
        expected_model_path: Startup check against /get_model_info's model_path.
        allow_truncated_sampling: Accept top_p < 1, top_k != -1 or min_p > 0.
        raise_on_failure: Default of `generate(raise_on_failure=...)`.
        topk_transport: "json" (nested triples), "flat_b64" (output-side base64 arrays in the
            same response) or "scoring_b64" (a second, prefill-only scoring request); see above.
        control_timeout_s: Timeout of control requests (health, weight updates).
        pause_mode: `mode` sent to /pause_generation ("abort", "retract" or "in_place").
        check_on_start: Run `check_server()` in the constructor.
    """

    def __init__(self, base_url: str, top_logprobs: int = 20, *, timeout_s: float = 600.0,
                 max_retries: int = 3, max_concurrency: int = 64, backoff_s: float = 0.5,
                 backoff_max_s: float = 30.0, seed: int = 0, vocab_size: int | None = None,
                 expected_model_path: str | None = None, allow_truncated_sampling: bool = False,
                 raise_on_failure: bool = False, topk_transport: str = "json",
                 control_timeout_s: float = 600.0, pause_mode: str = "abort",
                 check_on_start: bool = False):
        if topk_transport not in TOPK_TRANSPORTS:
            raise ValueError(f"topk_transport must be one of {TOPK_TRANSPORTS}")
        self.base_url = base_url.rstrip("/")
        self.top_logprobs = int(top_logprobs)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.max_concurrency = int(max_concurrency)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.seed = int(seed)
        self.vocab_size = vocab_size
        self.expected_model_path = expected_model_path
        self.allow_truncated_sampling = allow_truncated_sampling
        self.raise_on_failure = raise_on_failure
        self.topk_transport = topk_transport
        self.control_timeout_s = float(control_timeout_s)
        self.pause_mode = pause_mode
        self._rng = random.Random(seed)
        self._calls = 0
        self._known_version: str | None = None
        self.model_info: dict | None = None
        if check_on_start:
            self.check_server()

    # ------------------------------------------------------------------ control endpoints

    async def _acontrol(self, method: str, path: str, body: dict | None = None,
                        ok_statuses: tuple[int, ...] = (200,)) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.control_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.request(method, self.base_url + path, json=body) as resp:
                raw = await resp.read()
                if resp.status not in ok_statuses:
                    raise _AttemptError("http", f"{method} {path}: HTTP {resp.status}: "
                                        f"{raw[:300]!r}", retryable=False)
                if not raw.strip():
                    return {}
                try:
                    return loads(raw)
                except MalformedResponseError:
                    return {"text": raw.decode("utf-8", "replace")}

    def _control(self, method: str, path: str, body: dict | None = None) -> Any:
        return _run_sync(self._acontrol(method, path, body))

    def check_server(self) -> dict:
        """Startup checks: /health, /get_model_info (model path, vocab), /get_weight_version.

        Returns:
            The model info dict (with "weight_version").

        Raises:
            EngineMismatchError: Unhealthy server, other model or vocabulary.
        """
        try:
            self._control("GET", "/health")
        except (_AttemptError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineMismatchError(f"{self.base_url} is not healthy: {exc}") from exc
        info = self._control("GET", "/get_model_info")
        if self.expected_model_path is not None and info.get("model_path") != \
                self.expected_model_path:
            raise EngineMismatchError(f"server serves model {info.get('model_path')!r}, "
                                      f"expected {self.expected_model_path!r}")
        server_vocab = info.get("vocab_size")
        if self.vocab_size is not None and server_vocab is not None and \
                int(server_vocab) != int(self.vocab_size):
            raise EngineMismatchError(f"server vocab_size {server_vocab} != expected "
                                      f"{self.vocab_size}")
        if self.vocab_size is not None and server_vocab is None:
            logger.warning("/get_model_info reports no vocab_size; vocabulary not checked")
        info["weight_version"] = self.weight_version()
        self.model_info = info
        logger.info("SGLang server %s ok: model %s, weight_version %s", self.base_url,
                    info.get("model_path"), info["weight_version"])
        return info

    def weight_version(self) -> str:
        """Current weight version reported by the server (GET /get_weight_version)."""
        out = self._control("GET", "/get_weight_version")
        version = out.get("weight_version") if isinstance(out, dict) else out
        self._known_version = None if version is None else str(version)
        return self._known_version

    def pause_generation(self, mode: str | None = None) -> Any:
        """POST /pause_generation (in-flight items aborted this way are retried later)."""
        return self._control("POST", "/pause_generation", {"mode": mode or self.pause_mode})

    def continue_generation(self) -> Any:
        """POST /continue_generation."""
        return self._control("POST", "/continue_generation", {})

    def _synced_update(self, path: str, body: dict, version: str,
                       side_effect: Callable[[], None] | None = None) -> str:
        """pause -> POST path (+ side_effect in parallel) -> continue (always) -> verify."""
        self.pause_generation()
        error: BaseException | None = None
        try:
            if side_effect is None:
                out = self._control("POST", path, body)
            else:
                box: dict[str, Any] = {}

                def post():
                    try:
                        box["out"] = self._control("POST", path, body)
                    except BaseException as exc:  # noqa: BLE001 - re-raised below
                        box["error"] = exc

                thread = threading.Thread(target=post, daemon=True)
                thread.start()
                side_effect()
                thread.join()
                if "error" in box:
                    raise box["error"]
                out = box["out"]
            if isinstance(out, dict) and out.get("success") is False:
                error = WeightSyncError(f"{path} refused: {out.get('message')}")
        except Exception as exc:  # noqa: BLE001 - generation must resume first
            error = exc
        finally:
            self.continue_generation()
        if error is not None:
            if isinstance(error, WeightSyncError):
                raise error
            raise WeightSyncError(f"{path} failed: {error}") from error
        now = self.weight_version()
        if now != version:
            raise WeightSyncError(f"after {path} the server reports weight_version {now!r}, "
                                  f"expected {version!r}")
        logger.info("weights updated via %s to version %s", path, version)
        return version

    def update_weights_from_disk(self, model_path: str, weight_version: str, *,
                                 load_format: str | None = None, flush_cache: bool = True,
                                 **extra: Any) -> str:
        """Weight sync from a HF safetensors directory written by the trainer.

        Sequence: pause_generation -> update_weights_from_disk -> continue_generation (sent
        even if the update fails; the failure is raised afterwards as `WeightSyncError`).

        Args:
            model_path: Directory readable by the server (see `weights.save_hf_safetensors`).
            weight_version: Version recorded by the server in every later response.
            load_format: Optional SGLang load format.
            flush_cache: Flush the radix cache (stale KV from old weights).
            **extra: Further fields of the endpoint (e.g. is_async, keep_pause).

        Returns:
            The new version.
        """
        body = {"model_path": model_path, "weight_version": str(weight_version),
                "flush_cache": flush_cache, "abort_all_requests": False, **extra}
        if load_format is not None:
            body["load_format"] = load_format
        return self._synced_update("/update_weights_from_disk", body, str(weight_version))

    def update_weights(self, model_path: str, version: str, **kwargs: Any) -> str:
        """`RolloutEngine.update_weights`: `update_weights_from_disk(model_path, version)`."""
        return self.update_weights_from_disk(model_path, version, **kwargs)

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]],
                                   weight_version: str, *,
                                   serialize_fn: Callable[[list[tuple[str, Any]]], list[str]],
                                   load_format: str | None = None,
                                   flush_cache: bool = True) -> str:
        """Colocated GPU path (POST /update_weights_from_tensor), transport pluggable.

        Args:
            named_tensors: (name, tensor) pairs.
            weight_version: New version.
            serialize_fn: Maps the tensors to `serialized_named_tensors`, one string per
                server TP rank. With SGLang this is `MultiprocessingSerializer.serialize(...,
                output_str=True)` per rank (CUDA IPC handles; GPU-only, so not provided here).
            load_format: None, "direct", "flattened_bucket" or a custom loader.
            flush_cache: Flush the radix cache.

        Returns:
            The new version.
        """
        body = {"serialized_named_tensors": serialize_fn(named_tensors),
                "load_format": load_format, "flush_cache": flush_cache,
                "abort_all_requests": False, "weight_version": str(weight_version)}
        return self._synced_update("/update_weights_from_tensor", body, str(weight_version))

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int, group_name: str,
                                  backend: str = "nccl") -> Any:
        """POST /init_weights_update_group (NCCL group trainer rank 0 + server ranks)."""
        return self._control("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str, *,
                                        broadcast_fn: Callable[[], None],
                                        load_format: str | None = None,
                                        flush_cache: bool = True) -> str:
        """NCCL broadcast path (POST /update_weights_from_distributed), transport pluggable.

        The server blocks in the request until it has received the tensors, so the request runs
        in a helper thread while `broadcast_fn()` (e.g. `torch.distributed.broadcast` of each
        tensor from trainer rank 0 on the group set up by `init_weights_update_group`) runs in
        the caller's thread.

        Returns:
            The new version.
        """
        body = {"names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": False,
                "weight_version": str(weight_version), "load_format": load_format}
        return self._synced_update("/update_weights_from_distributed", body,
                                   str(weight_version), side_effect=broadcast_fn)

    def destroy_weights_update_group(self, group_name: str) -> Any:
        """POST /destroy_weights_update_group."""
        return self._control("POST", "/destroy_weights_update_group", {"group_name": group_name})

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
        """Body of the flat-b64 scoring request for the responses of one prompt."""
        return {"input_ids": [list(prompt) + list(r) for r in responses],
                "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                "rid": list(rids), "return_logprob": True, "logprob_start_len": len(prompt),
                "top_logprobs_num": self.top_logprobs, "return_text_in_logprobs": False,
                "return_flat_raw_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True,
                "stream": False}

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                 n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt (blocking wrapper of `agenerate`)."""
        return _run_sync(self.agenerate(prompt_ids, sampling_params, n,
                                        raise_on_failure=raise_on_failure))

    async def agenerate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                        n: int = 1, *, raise_on_failure: bool | None = None) -> RolloutBatch:
        """Samples n responses per prompt; every (prompt, sample) ends as sample or failure."""
        params = dict(sampling_params or {})
        temperature = check_sampling_params(params, self.allow_truncated_sampling)
        if "n" in params:
            raise ValueError("pass n as generate(..., n=...), not in sampling_params")
        self._calls += 1
        outcomes: dict[tuple[int, int], RolloutSample | RolloutFailure] = {}
        sem = asyncio.Semaphore(self.max_concurrency)
        connector = aiohttp.TCPConnector(limit=self.max_concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(
                self._run_prompt(session, sem, p, list(prompt), params, temperature, n, outcomes)
                for p, prompt in enumerate(prompt_ids)))
        raise_on_failure = self.raise_on_failure if raise_on_failure is None else raise_on_failure
        return assemble_batch(outcomes, len(prompt_ids), n, temperature=temperature,
                              top_logprobs=self.top_logprobs, prompt_ids=prompt_ids,
                              default_version=self._known_version,
                              raise_on_failure=raise_on_failure, vocab_size=self.vocab_size,
                              validated=True)

    def _backoff(self, attempt: int) -> float:
        base = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (0.5 + self._rng.random())

    async def _run_prompt(self, session, sem, p: int, prompt: list[int], params: dict,
                          temperature: float, n: int, outcomes: dict) -> None:
        pending = list(range(n))
        attempts = dict.fromkeys(pending, 0)
        while pending:
            for j in pending:
                attempts[j] += 1
            rids = [f"rb{self.seed}-{self._calls}-p{p}-s{j}-a{attempts[j]}" for j in pending]
            async with sem:
                results = await self._attempt(session, prompt, pending, params, temperature,
                                              rids)
            retry = []
            for j, res in zip(pending, results):
                key = (p, j)
                if key in outcomes:
                    raise AssertionError(f"duplicate outcome for prompt {p} sample {j}")
                if isinstance(res, RolloutSample):
                    res.meta_info["attempts"] = attempts[j]
                    outcomes[key] = res
                elif res.retryable and attempts[j] <= self.max_retries:
                    logger.info("prompt %d sample %d attempt %d failed (%s): %s; retrying", p, j,
                                attempts[j], res.kind, res)
                    retry.append(j)
                else:
                    logger.warning("prompt %d sample %d failed after %d attempt(s) (%s): %s", p,
                                   j, attempts[j], res.kind, res)
                    outcomes[key] = RolloutFailure(p, j, attempts[j], str(res), res.kind)
            if retry:
                await asyncio.sleep(self._backoff(max(attempts[j] for j in retry)))
            pending = retry

    async def _post(self, session, payload: dict) -> Any:
        """POSTs /generate; returns the decoded JSON or raises `_AttemptError`."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.post(self.base_url + "/generate", json=payload,
                                    timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            raise _AttemptError("timeout", f"no response within {self.timeout_s}s") from None
        except aiohttp.ClientError as exc:
            raise _AttemptError("connection", f"{type(exc).__name__}: {exc}") from None
        if status != 200:
            retryable = status >= 500 or status in (408, 429)
            raise _AttemptError("http", f"HTTP {status}: {raw[:200]!r}", retryable)
        loop = asyncio.get_running_loop()
        try:
            obj = await loop.run_in_executor(None, loads, raw)
        except MalformedResponseError as exc:
            raise _AttemptError("malformed", str(exc)) from None
        n_items = len(payload["input_ids"])
        if not isinstance(obj, list) or len(obj) != n_items:
            got = len(obj) if isinstance(obj, list) else type(obj).__name__
            raise _AttemptError("malformed", f"expected a list of {n_items} responses, got {got}")
        return obj

    async def _attempt(self, session, prompt: list[int], items: list[int], params: dict,
                       temperature: float, rids: list[str]) -> list:
        """One attempt for some items of a prompt: a sample or an `_AttemptError` per item."""
        b64 = self.topk_transport == "scoring_b64"
        payload = self.build_generate_payload(prompt, len(items), params, rids,
                                              top_logprobs=0 if b64 else self.top_logprobs)
        try:
            objs = await self._post(session, payload)
        except _AttemptError as exc:
            return [exc] * len(items)
        results: list = []
        for idx, obj in enumerate(objs):
            try:
                # scoring_b64: the final support (sampled token included) is validated once, when
                # the scoring response is folded in; structural checks still run here.
                sample = parse_response_object(obj, 0 if b64 else self.top_logprobs,
                                               self.vocab_size,
                                               idx, validate=not b64)
            except MalformedResponseError as exc:
                results.append(_AttemptError("malformed", str(exc)))
                continue
            except RolloutValidationError as exc:
                results.append(_AttemptError("invalid", str(exc)))
                continue
            if sample.finish_reason == "abort":
                message = (sample.meta_info.get("finish_reason_raw") or {})
                results.append(_AttemptError("abort", f"aborted: {message}"))
                continue
            sample.meta_info["rid"] = rids[idx]
            results.append(sample)
        if b64:
            await self._score(session, prompt, results, temperature, rids)
        return results

    async def _score(self, session, prompt: list[int], results: list, temperature: float,
                     rids: list[str]) -> None:
        """Replaces the samples in `results` by scored ones (or errors), in place."""
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
            objs = await self._post(session, payload)
            for i, o in zip(todo, objs):
                got = (o.get("meta_info") or {}).get("weight_version")
                want = results[i].meta_info.get("weight_version")
                if got != want:
                    raise _AttemptError("invalid", f"scoring ran on weight_version {got!r}, "
                                        f"generation on {want!r}")
            parse_scoring_response(objs, samples, self.top_logprobs, self.vocab_size)
        except _AttemptError as exc:
            for i in todo:
                results[i] = exc
            return
        except RolloutValidationError as exc:
            for i in todo:
                results[i] = _AttemptError("invalid", f"scoring: {exc}")
            return
        for s in samples:
            s.meta_info["scoring_s"] = time.perf_counter() - start
