"""A real HTTP server speaking SGLang's native protocol, backed by `LocalEngine`, for tests.

What: aiohttp app on 127.0.0.1 (free port) in a background thread implementing /generate (nested
`[logprob, id, null]` triples, batch -> list, the SGLang shapes of docs/engines.md), the flat
base64 prompt-side top-K of scoring requests, /health, /get_model_info, /get_weight_version,
/pause_generation, /continue_generation, /update_weights_from_disk (safetensors into the engine),
/update_weights_from_tensor, the distributed-update endpoints, plus per-request fault injection.

Why: the client's retry/bookkeeping logic and the parser must be exercised against real sockets,
real timeouts and real malformed bytes, without a GPU or the sglang package.

Faults: `server.fault_fn(body, call_no) -> Fault | None` is called for every /generate request.
`parse_rid` recovers (prompt, sample, attempt) from the client's request ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np
import orjson
import pybase64
import torch
from aiohttp import web

from rollout_bridge import LocalEngine

_RID = re.compile(r"-p(\d+)-s(\d+)-a(\d+)")


def parse_rid(rid: str) -> tuple[int, int, int]:
    """(prompt_index, sample_index, attempt) from an `SGLangEngine` request id."""
    m = _RID.search(rid)
    if m is None:
        raise ValueError(rid)
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@dataclasses.dataclass
class Fault:
    """Fault for one /generate request.

    Attributes:
        kind: None, "delay" (sleep delay_s first), "http500", "http400", "drop" (close the
            connection without a response), "malformed" (truncated JSON body), "not_list" (an
            object instead of the batch list).
        delay_s: Sleep before answering (any kind).
        abort_items: Sample indices (from the rid; else item positions) answered with
            finish_reason abort (partial output).
        ragged_items: Sample indices whose top-K lists are shortened at some positions.
        corrupt_items: Sample indices whose output_ids disagree with output_token_logprobs.
    """

    kind: str | None = None
    delay_s: float = 0.0
    abort_items: tuple[int, ...] = ()
    ragged_items: tuple[int, ...] = ()
    corrupt_items: tuple[int, ...] = ()


def _triples(lp: list[float], ids: list[int]) -> list[list]:
    return [[float(a), int(b), None] for a, b in zip(lp, ids)]


class FakeSGLangServer:
    """See module docstring.

    Args:
        engine: Engine used for generation and scoring.
        model_path: Reported by /get_model_info.
        report_vocab: Include "vocab_size" in /get_model_info.
    """

    def __init__(self, engine: LocalEngine, model_path: str = "tiny-lm",
                 report_vocab: bool = True):
        self.engine = engine
        self.model_path = model_path
        self.report_vocab = report_vocab
        self.fault_fn: Callable[[dict, int], Fault | None] | None = None
        self.tensor_deserializer: Callable[[list[str]], dict] | None = None
        self.calls: list[tuple[str, dict]] = []
        self.num_generate = 0
        self.paused = False
        self.deterministic_seeds = False
        """Seed every item by (prompt, sample index) instead of arrival order (reproducible
        rollouts under the client's concurrent requests)."""
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake SGLang server did not start")
        return self.url

    async def _start(self) -> None:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/get_weight_version", self._weight_version)
        for name in ("pause_generation", "continue_generation", "update_weights_from_disk",
                     "update_weights_from_tensor", "init_weights_update_group",
                     "update_weights_from_distributed", "destroy_weights_update_group"):
            app.router.add_post("/" + name, self._control)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # ------------------------------------------------------------------ endpoints

    async def _health(self, request: web.Request) -> web.Response:
        self.calls.append(("health", {}))
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        self.calls.append(("get_model_info", {}))
        info = {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version()}
        if self.report_vocab:
            info["vocab_size"] = self.engine.vocab_size
        return web.json_response(info)

    async def _weight_version(self, request: web.Request) -> web.Response:
        self.calls.append(("get_weight_version", {}))
        return web.json_response({"weight_version": self.engine.weight_version()})

    async def _control(self, request: web.Request) -> web.Response:
        name = request.path.strip("/")
        body = await request.json() if request.can_read_body else {}
        self.calls.append((name, body))
        if name == "pause_generation":
            self.paused = True
        elif name == "continue_generation":
            self.paused = False
        elif name == "update_weights_from_disk":
            try:
                with self._lock:
                    self.engine.load_weights_from_disk(body["model_path"],
                                                       body.get("weight_version"))
            except Exception as exc:  # noqa: BLE001 - reported like SGLang does
                return web.json_response({"success": False, "message": str(exc),
                                          "num_paused_requests": 0}, status=400)
        elif name == "update_weights_from_tensor":
            if self.tensor_deserializer is None:
                return web.json_response({"success": False, "message": "no deserializer"})
            with self._lock:
                self.engine.update_weights(
                    self.tensor_deserializer(body["serialized_named_tensors"]),
                    body.get("weight_version"))
        elif name == "update_weights_from_distributed":
            with self._lock:  # the weights "arrive" by broadcast; only the version changes
                self.engine._version = str(body.get("weight_version"))
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.num_generate += 1
        self.calls.append(("generate", body))
        fault = self.fault_fn(body, self.num_generate) if self.fault_fn else None
        fault = fault or Fault()
        while self.paused:
            await asyncio.sleep(0.005)
        if fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault.kind == "http500":
            return web.Response(status=500, text="Internal Server Error")
        if fault.kind == "http400":
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        if fault.kind == "drop":
            request.transport.close()
            raise asyncio.CancelledError()
        if body.get("return_flat_raw_top_logprobs_b64") and not (
                body.get("return_flat_raw_top_logprobs")
                or body.get("return_flat_raw_output_top_logprobs")):
            # SGLang's GenerateReqInput refuses this combination (io_struct, 0.5.23)
            return web.json_response({"error": {"message": "return_flat_raw_top_logprobs_b64 "
                                                 "requires return_flat_raw_top_logprobs or "
                                                 "return_flat_raw_output_top_logprobs."}},
                                     status=400)
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(None, self._answer, body, fault)
        raw = orjson.dumps(out)
        if fault.kind == "malformed":
            raw = raw[: len(raw) // 2]
        if fault.kind == "not_list":
            raw = orjson.dumps(out[0] if isinstance(out, list) else out)
        return web.Response(body=raw, content_type="application/json")

    # ------------------------------------------------------------------ generation

    def _answer(self, body: dict, fault: Fault) -> list | dict:
        ids = body["input_ids"]
        single = not (ids and isinstance(ids[0], list))
        items = [ids] if single else ids
        rids = body.get("rid") or [f"req{i}" for i in range(len(items))]
        rids = [rids] if isinstance(rids, str) else rids
        params = body.get("sampling_params") or {}
        k = int(body.get("top_logprobs_num") or 0)
        out = []
        for i, prompt in enumerate(items):
            start = time.perf_counter()
            try:  # faulty items are chosen by the client's sample index, else by position
                key = parse_rid(rids[i])[1]
            except ValueError:
                key = i
            if int(params.get("max_new_tokens", 16)) == 0:
                obj = self._score(prompt, params, body, k)
            else:
                obj = self._one(prompt, params, k, key in fault.abort_items,
                                key in fault.ragged_items, key in fault.corrupt_items,
                                seed_key=key)
                if k > 0 and body.get("return_flat_raw_output_top_logprobs"):
                    _flatten_output_top(obj["meta_info"], k,
                                        bool(body.get("return_flat_raw_top_logprobs_b64")))
            obj["meta_info"]["id"] = rids[i]
            obj["meta_info"]["e2e_latency"] = time.perf_counter() - start
            out.append(obj)
        return out[0] if single else out

    def _one(self, prompt: list[int], params: dict, k: int, abort: bool, ragged: bool,
             corrupt: bool, seed_key: int = 0) -> dict:
        gen_params = {key: v for key, v in params.items() if key != "n"}
        with self._lock:
            if self.deterministic_seeds:
                self.engine._calls = zlib.crc32(repr((list(prompt), seed_key)).encode())
            saved_k = self.engine.top_logprobs
            self.engine.top_logprobs = max(k, 0)
            try:
                s = self.engine.generate([prompt], gen_params, n=1).samples[0]
            finally:
                self.engine.top_logprobs = saved_k
        resp = s.response_ids.tolist()
        lp = s.behavior_logprob.tolist()
        t = len(resp)
        finish = {"type": s.finish_reason}
        finish.update({"matched": resp[-1]} if s.finish_reason == "stop" else {"length": t})
        top = None
        if k > 0:
            # Reconstruct the engine's raw top-K (undo the folding of the sampled token).
            top = []
            ids_ts, lp_ts = s.support_ids.tolist(), s.support_logprobs.tolist()
            for pos in range(t):
                top.append(_triples(lp_ts[pos][:k], ids_ts[pos][:k]))
        if abort:
            cut = t // 2
            resp, lp, t = resp[:cut], lp[:cut], cut
            top = top[:cut] if top is not None else None
            finish = {"type": "abort", "message": "Abort before prefill"}
        if ragged and top:
            for pos in range(0, t, 3):
                top[pos] = top[pos][: max(0, k - 1 - pos % 4)]
        output_ids = list(resp)
        if corrupt and t:
            output_ids[-1] = (output_ids[-1] + 1) % self.engine.vocab_size
        meta = {"id": "", "finish_reason": finish, "prompt_tokens": len(prompt),
                "completion_tokens": t, "cached_tokens": 0,
                "weight_version": self.engine.weight_version(), "e2e_latency": 0.0,
                "input_token_logprobs": [], "output_token_logprobs": _triples(lp, resp),
                "output_token_logprobs_length": t}
        if k > 0:
            meta["input_top_logprobs"] = []
            meta["output_top_logprobs"] = top
        return {"text": "".join(f"<{x}>" for x in output_ids), "output_ids": output_ids,
                "meta_info": meta}

    def _score(self, input_ids: list[int], params: dict, body: dict, k: int) -> dict:
        """Prefill-only request: prompt-side logprobs from logprob_start_len, flat b64 top-K."""
        temperature = float(params.get("temperature", 1.0))
        with self._lock:
            lp_lv = self.engine.score(input_ids, temperature)
        start = body.get("logprob_start_len")
        start = 0 if start is None or start < 0 else int(start)
        length = len(input_ids)
        # Covered positions q = start..L-1; position q is scored by logits row q-1.
        null_prefix = 1 if start == 0 else 0
        rows_q = np.arange(start + null_prefix, length)
        dist_rv = lp_lv[torch.as_tensor(rows_q - 1, dtype=torch.int64)]
        tok = torch.as_tensor(input_ids, dtype=torch.int64)[torch.as_tensor(rows_q)]
        tok_lp = dist_rv.gather(1, tok[:, None])[:, 0].tolist()
        input_token_logprobs = [[None, input_ids[0], None]] * null_prefix + _triples(
            tok_lp, tok.tolist())
        meta = {"id": "", "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": length, "completion_tokens": 0, "cached_tokens": 0,
                "weight_version": self.engine.weight_version(), "e2e_latency": 0.0,
                "input_token_logprobs": input_token_logprobs, "output_token_logprobs": []}
        if k > 0:
            vals_rk, idx_rk = torch.topk(dist_rv, k, dim=-1)
            if body.get("return_flat_raw_top_logprobs_b64"):
                meta.update({
                    "input_top_logprobs_val_flat_b64": pybase64.b64encode(
                        vals_rk.numpy().astype("<f4").tobytes()).decode(),
                    "input_top_logprobs_idx_flat_b64": pybase64.b64encode(
                        idx_rk.numpy().astype("<i4").tobytes()).decode(),
                    "input_top_logprobs_val_flat_b64_dtype": "float32",
                    "input_top_logprobs_idx_flat_b64_dtype": "int32",
                    "input_top_logprobs_shape": [int(vals_rk.shape[0]), k],
                    "input_top_logprobs_null_prefix": null_prefix})
            else:
                meta["input_top_logprobs"] = [None] * null_prefix + [
                    _triples(v, i) for v, i in zip(vals_rk.tolist(), idx_rk.tolist())]
        meta["output_top_logprobs"] = []
        return {"text": "", "output_ids": [], "meta_info": meta}


def _flatten_output_top(meta: dict, k: int, b64: bool) -> None:
    """SGLang's `return_flat_raw_output_top_logprobs`: replaces the nested output top-K of a
    finished response by [rows, k] arrays (base64 little-endian float32/int32 with `b64`), or
    keeps the nested form when the rows are not rectangular (SGLang falls back the same way)."""
    top = meta["output_top_logprobs"] or []
    null_prefix = 0
    while null_prefix < len(top) and not top[null_prefix]:
        null_prefix += 1
    rows = top[null_prefix:]
    if any(row is None or len(row) != k for row in rows):
        return
    vals = np.asarray([[e[0] for e in row] for row in rows], dtype="<f4").reshape(len(rows), k)
    idx = np.asarray([[e[1] for e in row] for row in rows], dtype="<i4").reshape(len(rows), k)
    del meta["output_top_logprobs"]
    if b64:
        meta.update({
            "output_top_logprobs_val_flat_b64": pybase64.b64encode(vals.tobytes()).decode(),
            "output_top_logprobs_idx_flat_b64": pybase64.b64encode(idx.tobytes()).decode(),
            "output_top_logprobs_val_flat_b64_dtype": "float32",
            "output_top_logprobs_idx_flat_b64_dtype": "int32"})
    else:
        meta.update({"output_top_logprobs_val_flat": vals.reshape(-1).tolist(),
                     "output_top_logprobs_idx_flat": idx.reshape(-1).tolist()})
    meta["output_top_logprobs_shape"] = [len(rows), k]
    meta["output_top_logprobs_null_prefix"] = null_prefix


# ---------------------------------------------------------------------------------------------
# HF-backed mode: a transformers causal LM (e.g. Qwen3MoeForCausalLM) loaded from an HF directory
# and reloaded from the directory named by /update_weights_from_disk, like a real SGLang server.
# ---------------------------------------------------------------------------------------------


def load_hf_causal_lm(model_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers AutoModelForCausalLM from local files, eval mode, fp32 by default."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True,
                                                 dtype=dtype)
    return model.eval()


class HFModelEngine(LocalEngine):
    """`LocalEngine` over an HF model directory; `load_weights_from_disk` reloads the model.

    Right-padded batches are fine without an attention mask (causal model: padding after a
    sequence's last token cannot change its logits).
    """

    def __init__(self, model_path: str, *, top_logprobs: int = 0, seed: int = 0,
                 eos_token_id: int | None = None, dtype: torch.dtype = torch.float32,
                 weight_version: str = "0"):
        self.dtype = dtype
        self.model_path = model_path
        model = load_hf_causal_lm(model_path, dtype)
        super().__init__(model, vocab_size=model.config.vocab_size, top_logprobs=top_logprobs,
                         seed=seed,
                         eos_token_id=eos_token_id, max_batch_size=256,
                         weight_version=weight_version)
        self.loaded_paths = [model_path]

    def load_weights_from_disk(self, model_path: str, version: str | None = None,
                               name_map=None) -> str:
        new = load_hf_causal_lm(model_path, self.dtype)
        if new.config.vocab_size != self.vocab_size:
            raise ValueError(f"{model_path}: vocab_size {new.config.vocab_size} != "
                             f"{self.vocab_size}")
        self.model = new
        self.model_path = model_path
        self.loaded_paths.append(model_path)
        self._num_updates += 1
        self._version = str(version) if version is not None else str(self._num_updates)
        return self._version


def main(argv=None) -> None:
    """`python tests/bridge/fake_sglang.py --hf-dir DIR --port-file F`: serve until killed."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(description="fake SGLang server over an HF model dir")
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-file", default=None, help="append one JSON line per control call")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    engine = HFModelEngine(args.hf_dir, seed=args.seed)
    server = FakeSGLangServer(engine, model_path=args.hf_dir)
    server.deterministic_seeds = True
    server.start()
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.port))
    os.replace(tmp, args.port_file)
    print(f"fake SGLang server on {server.url}", flush=True)
    seen = 0
    try:
        while True:
            time.sleep(0.2)
            if args.log_file and len(server.calls) > seen:
                with open(args.log_file, "a") as f:
                    for name, body in server.calls[seen:]:
                        if name != "generate":
                            f.write(orjson.dumps({"call": name, "body": body}).decode() + "\n")
                seen = len(server.calls)
    except KeyboardInterrupt:
        server.stop()
        sys.exit(0)


if __name__ == "__main__":
    main()
