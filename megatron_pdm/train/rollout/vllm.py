"""Rollouts from a vLLM server and the in-memory weight sync that keeps it on-policy (`engine: vllm`).

Rollout: global rank 0 sends the iteration's prompts to `rollout_bridge.vllm.client.VLLMEngine`
(`rollout.vllm.url`; token ids in, top-K log-probs with ids out, one seed per sample); the rank-0
driving, the background generation of `rollout.overlap`, the version check and the broadcast to
every rank are `ServerRollout`'s (server.py), composed with `VLLMGlue` (this file).

Weight sync (`VLLMGlue.push`, collective; once before the first rollout, after each iteration's
optimizer steps, after a resume):
1. `megatron_pdm.convert.live.gather_hf_state_dict` gathers the live, sharded model (any
   TP/EP/PP) as full HF-named tensors on global rank 0, one layer group at a time (vocabulary
   padding stripped) - no checkpoint, no disk;
2. rank 0 serialises them as one safetensors blob and `VLLMEngine.update_weights` sends it,
   base64, through `/collective_rpc` to the worker extension (rollout_bridge/vllm/worker_ext.py),
   which reloads the weights in place and re-runs the CPU MoE expert prepack that vLLM 0.32.0
   and 0.33.0 skip on reload; the worker's digest of what it loaded must equal the trainer's
   (`canonical_digest`), then the version is set and read back.
Dtype: fp32/None rollout precision pushes the training dtype (the fp32 server then holds exactly
the trainer's weights: the CI exactness check), bf16/fp8 push bf16 (an fp32 CPU server holds the
bf16-rounded weights, the same mismatch as the local engine's bf16 simulation; a GPU server
started with --dtype bfloat16 / --quantization fp8 casts or quantises on load).

Cost: one gather (all_gather_object of the manifests + one send/recv per shard) and one HTTP
request carrying 4/3 x the model's bytes: fine for small models (the tiny CPU model: ~0.6 MB,
~0.1-0.5 s under load). Large models on GPUs use vLLM's weight-transfer engine instead (NCCL
broadcast, `VLLMEngine.update_weights_via_transfer`; docs/engines.md, vLLM), not wired here.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def vllm_client(cfg, vocab_size: int | None):
    """The `VLLMEngine` of a run config's `rollout.vllm` section (the run's rollouts, and
    megatron-pdm-eval-heldout's evaluation of a served model); `vocab_size` None: unchecked."""
    from rollout_bridge.core.apikey import read_api_key
    from rollout_bridge.vllm.client import VLLMEngine

    r = cfg.rollout
    key = read_api_key(r.vllm.api_key_env)
    if key is None:
        logger.warning("rollout.vllm.api_key_env=%s is not set: requests carry no API key",
                       r.vllm.api_key_env)
    return VLLMEngine(
        r.vllm.url, top_logprobs=r.top_logprobs, api_key=key, timeout_s=r.timeout_s,
        max_retries=r.max_retries, seed=cfg.seed, vocab_size=vocab_size,
        raise_on_failure=True, recover_timeout_s=r.vllm.restart_wait_s,
        pause_wait_s=r.vllm.pause_wait_s,
        allow_insecure_dev_routes=r.vllm.allow_insecure_dev_routes,
        push_dir=r.vllm.push_dir)


class VLLMGlue:
    """vLLM's part of a `ServerRollout` (server.py `EngineGlue`): the client, the start-up
    facts, the in-memory push and the client's request-seed counter."""

    name = "vllm"

    def __init__(self, cfg, arch):
        self.cfg = cfg
        self.arch = arch
        if cfg.rollout.rollout_precision in ("bf16", "fp8"):
            self.push_dtype = torch.bfloat16
        else:
            self.push_dtype = {"fp32": torch.float32,
                               "bf16": torch.bfloat16}[cfg.precision.params_dtype]
        self.last_push: dict = {}

    def make_client(self):
        return vllm_client(self.cfg, self.arch.vocab_size)

    def check_server(self, client) -> dict:
        info = client.check_server()
        facts = info["facts"][0]
        logger.info("vLLM server %s: model %s, vLLM %s, dtype %s, vocab %s, weight version %s, "
                    "dev routes %s", self.cfg.rollout.vllm.url, info["model"],
                    info["vllm_version"], facts.get("dtype"), facts.get("vocab_size"),
                    info["weight_version"],
                    "guarded by the API key" if info["dev_routes_guarded"] else "OPEN")
        return {"engine": "vllm", "model": info["model"], "weight_version": info["weight_version"],
                "vllm_version": info["vllm_version"], "dtype": facts.get("dtype")}

    def push(self, rollout, version: str) -> None:
        """Collective: gather the live weights on rank 0 and push them to vLLM as `version`."""
        from megatron_pdm.convert.live import gather_hf_state_dict

        state = gather_hf_state_dict(rollout.module(), self.arch, dst=0, dtype=self.push_dtype,
                                     expert_layout="per_expert", device="cpu")

        def push():
            client = rollout.client
            client.update_weights(state, str(version))
            info = client.last_push_info
            return {"bytes": info.get("bytes"), "push_s": info.get("push_s"),
                    "digest": info.get("digest"), "repushes": client.num_repushes}

        self.last_push = rollout.on_rank0(push)
        state.clear()

    def client_state(self, client):
        return client.state_dict()  # the request-seed counter: exact resume and evaluations

    def load_client_state(self, client, state) -> None:
        client.load_state_dict(state)
