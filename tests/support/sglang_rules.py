"""The request checks of SGLang's HTTP server, for the fake server (what a real one refuses).

Each rule restates a check of sglang 0.5.22/0.5.23 (paths relative to `sglang`, 0.5.23 lines);
tests/rollout_bridge/sglang/test_sglang_api.py runs the same table of requests through the installed
sglang's real HTTP app and TokenizerManager and requires the same HTTP status and error shape
from `check_generate` for every case:
  * shape "pydantic": the body does not parse into GenerateReqInput -> 400
    {"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}
    (entrypoints/http_server.py:636);
  * shape "contract": api_contract.generate_contract_error (unknown sampling_params keys, wrong
    types) -> 400 {"error": "<text>"} (http_server.py:937);
  * shape "value": ValueError in the tokenizer manager (normalize_batch_and_arguments,
    SamplingParams.normalize/verify) -> 400 {"error": {"message": "<text>"}} (:2246);
  * shape "stream": the same ValueError with stream=true -> HTTP 200 with one SSE error event
    and `data: [DONE]` (http_server.py:949-975).
Control bodies: msgspec structs, unknown keys ignored, missing fields -> shape "pydantic".
The weight-update session (scheduler_components/weight_updater.py:187-199, 309-330) and the API
key (utils/auth.py:74-213) are in `Session` / `auth_ok`.
"""

from __future__ import annotations

import json

SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "watermark", "beam_width"}
"""Keys SGLang's JSON contract accepts in `sampling_params` (checked in CI: each passes the real
contract, any other key is refused)."""

UNAUTHENTICATED_PREFIXES = ("/health", "/ready", "/metrics")


class Rejected(Exception):
    """A request the real server refuses: `status`, `body` (its JSON), `shape`."""

    def __init__(self, shape: str, message: str, status: int = 400):
        super().__init__(message)
        self.shape, self.status, self.message = shape, status, message

    @property
    def body(self) -> dict:
        if self.shape == "pydantic":
            return {"object": "error", "message": self.message, "type": "Bad Request",
                    "param": None, "code": 400}
        if self.shape == "contract":
            return {"error": self.message}
        if self.shape == "unauthorized":
            return {"error": "Unauthorized"}
        if self.shape == "not_found":
            return {"detail": "Not Found"}
        if self.shape == "stream":
            event = {"error": {"message": self.message, "type": "invalid_request_error",
                               "code": 400, "retryable": False}}
            return "data: " + json.dumps(event, separators=(",", ":")) + "\n\ndata: [DONE]\n\n"
        return {"error": {"message": self.message}}


def error_shape(status: int, body) -> str:
    """The shape name of an error body (inverse of `Rejected.body`)."""
    if status == 401:
        return "unauthorized"
    if status == 404:
        return "not_found"
    if status == 200 and isinstance(body, str) and body.startswith('data: {"error"'):
        return "stream"
    if isinstance(body, dict) and body.get("object") == "error":
        return "pydantic"
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return "contract"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return "value"
    if isinstance(body, dict) and body.get("success") is False:
        return "refused"
    return "other"


def auth_ok(path: str, method: str, headers, api_key: str | None) -> bool:
    """utils/auth.py: with --api-key every route but /health*, /ready*, /metrics* (and OPTIONS)
    needs `Authorization: Bearer <key>` (scheme case-insensitive)."""
    if api_key is None or method == "OPTIONS" or path.startswith(UNAUTHENTICATED_PREFIXES):
        return True
    value = headers.get("Authorization") or headers.get("authorization") or ""
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and token.strip() == api_key


def _is_int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in x)


def check_generate(body, vocab_size: int) -> None:
    """Raises `Rejected` where the real /generate handler refuses `body` (module docstring)."""
    if not isinstance(body, dict):
        raise Rejected("pydantic", "body is not an object")
    ids = body.get("input_ids")
    if ids is not None and not (_is_int_list(ids) or (isinstance(ids, list) and
                                                      all(_is_int_list(x) for x in ids))):
        raise Rejected("pydantic", "input_ids: Input should be a valid list of integers")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise Rejected("pydantic", "rid: Input should be a valid string or list")
    sps = body.get("sampling_params") or {}
    sps = sps if isinstance(sps, list) else [sps]
    for sp in sps:
        if not isinstance(sp, dict):
            raise Rejected("contract", "sampling_params: expected an object")
        unknown = sorted(set(sp) - SAMPLING_FIELDS)
        if unknown:
            raise Rejected("contract", f"unknown field `{unknown[0]}`")
    batch = len(ids) if ids and isinstance(ids[0], list) else 1
    # normalize_batch_and_arguments -> _validate_inputs (io_struct.py:444-477)
    flat = body.get("return_flat_raw_top_logprobs") or \
        body.get("return_flat_raw_output_top_logprobs")
    if body.get("return_flat_raw_output_top_logprobs") and body.get("stream"):
        # raised inside the stream generator: HTTP 200 + one SSE error event (http_server.py:949)
        raise Rejected("stream", "return_flat_raw_output_top_logprobs is only set on the "
                       "finished response and does not support stream=True.", status=200)
    if body.get("return_flat_raw_top_logprobs_b64") and not flat:
        raise Rejected("value", "return_flat_raw_top_logprobs_b64 requires "
                       "return_flat_raw_top_logprobs or return_flat_raw_output_top_logprobs.")
    if isinstance(rid, list):
        if len(rid) != batch:
            raise Rejected("value", "The specified rids length mismatch with the batch_size "
                           "for batch processing.")
        if len(set(rid)) != len(rid):
            raise Rejected("value", "Duplicate request IDs detected within the request")
    # SamplingParams.normalize/verify (sampling/sampling_params.py), --skip-tokenizer-init
    for sp in sps:
        top_k = sp.get("top_k", -1)
        if top_k is not None and top_k != -1 and top_k < 1:
            raise Rejected("value", f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        top_p = sp.get("top_p", 1.0)
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise Rejected("value", f"top_p must be in (0, 1], got {top_p}.")
        temperature = sp.get("temperature", 1.0)
        if temperature is not None and temperature < 0:
            raise Rejected("value", "temperature must be a non-negative finite number, got "
                           f"{temperature}.")
        if sp.get("min_new_tokens") or sp.get("stop") or sp.get("stop_regex"):
            raise Rejected("value", "This request requires a tokenizer, but the tokenizer was "
                           "not initialized (--skip-tokenizer-init).")
        for key in (sp.get("logit_bias") or {}):
            if not 0 <= int(key) < vocab_size:
                raise Rejected("value", f"logit_bias must has keys in [0, {vocab_size}), got "
                               f"{key}.")
        grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if sp.get(k)]
        if len(grammars) > 1:
            raise Rejected("value", "Only one of regex, json_schema, or ebnf can be set.")


CONTROL_REQUIRED = {
    "update_weights_from_disk": ("model_path",),
    "update_weights_from_distributed": ("names", "dtypes", "shapes"),
    "update_weights_from_tensor": ("serialized_named_tensors",),
    "init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size"),
}
PAUSE_MODES = ("abort", "retract", "in_place")


def check_control(name: str, body) -> None:
    """Control bodies (io_struct.py msgspec structs): required fields, pause mode literal."""
    body = body if isinstance(body, dict) else {}
    missing = [k for k in CONTROL_REQUIRED.get(name, ()) if k not in body]
    if missing:
        raise Rejected("pydantic", f"{missing[0]}: Field required")
    if name == "pause_generation" and body.get("mode", "abort") not in PAUSE_MODES:
        raise Rejected("pydantic", "mode: Input should be 'abort', 'retract' or 'in_place'")
    if name == "update_weights_from_distributed" and \
            body.get("load_format") not in (None, "flattened_bucket"):
        raise Rejected("refused", f"unknown load_format {body.get('load_format')!r}")


class Session:
    """The scheduler's weight-update session (scheduler_components/weight_updater.py)."""

    def __init__(self):
        self.open = False
        self.loaded = False

    def begin(self) -> tuple[bool, str]:
        if self.open:
            return False, ("a weight-update session is already open; call end_weight_update() "
                           "first")
        self.open, self.loaded = True, False
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self.open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.open = False
        return True, "Success"

    def require(self, what: str) -> tuple[bool, str] | None:
        if not self.open:
            return False, (f"{what} must run between begin_weight_update() and "
                           "end_weight_update()")
        return None
