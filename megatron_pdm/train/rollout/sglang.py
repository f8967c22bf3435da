"""Rollouts from SGLang servers and the weight sync that keeps them on-policy (`engine: sglang`).

Rollout: global rank 0 sends the iteration's prompts to `rollout_bridge.SGLangEngine`
(`rollout.sglang.url`, or several servers in `rollout.sglang.urls`: prompts spread round-robin,
a retry goes to the next server; token ids in, top-K logprobs out); the rank-0 driving, the
version check and the broadcast to every rank are `ServerRollout`'s (server.py), composed with
`SGLangGlue` (this file). The API
key (SGLang --api-key) comes from `rollout.sglang.api_key_file` or the environment variable named
by `rollout.sglang.api_key_env`; only those names are in the config.

Weight sync (after each iteration's optimizer steps, once before the first rollout, after a
resume), `rollout.sglang.weight_sync.mode`:

* "distributed" (no disk): `convert.live.iter_hf_groups` gathers the live, sharded model (any
  TP/EP/PP) as full HF tensors on rank 0, one layer group at a time, and
  `rollout_bridge.sglang.broadcast.DistributedWeightSender` streams them to every server: one
  weight-update group (trainer rank 0 + every server TP rank, created once with
  /init_weights_update_group and rank offsets per server), buckets of
  `rollout.sglang.weight_sync.bucket_mb` posted with /update_weights_from_distributed while
  rank 0 broadcasts them (NCCL on GPUs, gloo on CPUs), the next layer gathered while a bucket is
  on the wire, all inside one pause -> begin_weight_update ... end_weight_update -> continue
  session; the last bucket sets the weight version, which every server must then report. Rank 0
  keeps consuming the gather even when the push fails (the gather is collective), then the error
  reaches every rank.
* "disk" (fallback, shared file system): every rank saves its shard with megatron
  `dist_checkpointing` into `<hf_checkpoint>/.dist_v<version>` (`rollout.sglang.hf_checkpoint`);
  rank 0 streams it to HF safetensors with `convert.export.export_to_hf` into
  `<hf_checkpoint>/v<version>` and calls `update_weights_from_disk` on every server (pause ->
  update -> continue -> version check). For Qwen3-30B-A3B in bf16 that is ~3 x 61 GB of file
  I/O per iteration; `rollout.sglang.keep_synced` directories are kept.

Push dtype: bf16 for rollout_precision bf16/fp8 (fp8 servers quantise on load), else the
training dtype. Each push is recorded in `<output_dir>/weight_sync.jsonl` (rank 0: version,
mode, seconds, buckets, bytes and, with `rollout.sglang.weight_sync.digest`, the sha256 state
digest).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import torch
import torch.distributed as dist

from megatron_pdm.netutil import free_port
from megatron_pdm.train.rollout.server import capture, share_from_rank0

logger = logging.getLogger(__name__)


def push_dtype_name(cfg) -> str:
    """The weight sync's dtype: bf16 for rollout_precision bf16/fp8 (fp8 servers quantise on
    load), else the training dtype (the simulation's bucket plan uses the same rule)."""
    if cfg.rollout.rollout_precision in ("bf16", "fp8"):
        return "bf16"
    return cfg.precision.params_dtype


class SGLangGlue:
    """SGLang's part of a `ServerRollout` (server.py `EngineGlue`): the client (and the
    broadcast sender of the distributed weight sync) and the push, distributed or by disk."""

    name = "sglang"

    def __init__(self, cfg, arch, *, meta: dict | None, style: str):
        r = cfg.rollout
        self.cfg = cfg
        self.arch = arch
        self.style = style
        self.root = os.path.abspath(r.sglang.hf_checkpoint) if r.sglang.hf_checkpoint else None
        self.meta_base = meta or {}
        self.load_dir = cfg.checkpoint.load_dir
        self.export_dtype = push_dtype_name(cfg)
        self.push_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.export_dtype]
        self.sender = None
        self.last_push: dict = {}
        self.log_path = os.path.join(cfg.output_dir, "weight_sync.jsonl")

    def make_client(self):
        from rollout_bridge import SGLangEngine
        from rollout_bridge.core.apikey import read_api_key

        r = self.cfg.rollout
        key = read_api_key(r.sglang.api_key_env, r.sglang.api_key_file)
        if key is None:
            logger.warning("no SGLang API key (rollout.sglang.api_key_env=%s is unset): anyone "
                           "who reaches the servers can replace the policy",
                           r.sglang.api_key_env)
        if self.root is not None:
            os.makedirs(self.root, exist_ok=True)
        client = SGLangEngine(
            r.sglang.urls or r.sglang.url, top_logprobs=r.top_logprobs, api_key=key,
            timeout_s=r.timeout_s, max_retries=r.max_retries, seed=self.cfg.seed,
            vocab_size=self.arch.vocab_size, raise_on_failure=True,
            topk_transport=r.sglang.topk_transport)
        if r.sglang.weight_sync.mode == "distributed":
            from rollout_bridge.sglang.broadcast import DistributedWeightSender

            ws = r.sglang.weight_sync
            port = ws.master_port or free_port(ws.master_addr)
            self.sender = DistributedWeightSender(
                client, master_address=ws.master_addr, master_port=port,
                backend=ws.backend, bucket_bytes=ws.bucket_mb << 20,
                load_format=(None if ws.load_format == "per_tensor"
                             else "flattened_bucket"), timeout_s=r.timeout_s)
        return client

    def check_server(self, client):
        return client.check_server()

    def client_state(self, client):
        return None  # each server seeds its own sampling

    def load_client_state(self, client, state) -> None:
        pass

    # ------------------------------------------------------------------ weight sync

    def push(self, rollout, version: str) -> None:
        """Collective: push the current weights to every server as `version`."""
        t0 = time.time()
        if self.cfg.rollout.sglang.weight_sync.mode == "distributed":
            stats = self._push_distributed(rollout, version)
        else:
            stats = self._push_disk(rollout, version)
        stats = dict(stats or {}, version=str(version),
                     mode=self.cfg.rollout.sglang.weight_sync.mode, seconds=time.time() - t0)
        self.last_push = stats
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(stats) + "\n")

    def _push_distributed(self, rollout, version: str) -> dict:
        from megatron_pdm.convert.live import iter_hf_groups

        r = self.cfg.rollout
        device = "cpu" if r.sglang.weight_sync.backend == "gloo" else None
        groups = iter_hf_groups(rollout.module(), self.arch, dst=0, dtype=self.push_dtype,
                                expert_layout="per_expert", device=device)
        outcome = None
        if dist.get_rank() == 0:
            digests: list[str] | None = [] if r.sglang.weight_sync.digest else None

            from rollout_bridge.core.weights import combine_digests, tensor_digest

            def named():
                for _, group in groups:
                    for name, tensor in group.items():
                        if digests is not None:
                            digests.append(tensor_digest(name, tensor))
                        yield name, tensor

            def push():
                stats = self.sender.push(named(), str(version))
                if digests is not None:
                    stats["digest"] = combine_digests(digests)
                return stats

            try:
                outcome = capture(push, f"weight sync to version {version} failed")
            finally:
                # Collective (live gather, default group): finish it whatever happened
                for _ in groups:
                    pass
        else:
            # Collective (live gather, default group): send this rank's shards to rank 0
            for _ in groups:
                pass
        # Collective: the push's stats (or its error) reach every rank.
        return share_from_rank0(outcome)

    def _meta(self) -> dict:
        from megatron.core import parallel_state as ps

        return {
            "format": "megatron-core dist_checkpointing torch_dist",
            "arch": self.arch.to_dict(),
            "layout_at_import": {"tp": ps.get_tensor_model_parallel_world_size(),
                                 "ep": ps.get_expert_model_parallel_world_size(),
                                 "pp": ps.get_pipeline_model_parallel_world_size(), "etp": 1},
            "params_dtype": self.cfg.precision.params_dtype,
            "key_style": self.style,
            "source": {"expert_layout": "per_expert", "dtype": self.export_dtype},
            "hf_config": self.meta_base.get("hf_config") or {},
        }

    def _push_disk(self, rollout, version: str) -> dict:
        from megatron_pdm.mcore.checkpoint import save_model

        scratch = os.path.join(self.root, f".dist_v{version}")
        target = os.path.join(self.root, f"v{version}")
        if dist.get_rank() == 0 and os.path.isdir(scratch):
            shutil.rmtree(scratch)
        save_model(scratch, rollout.module())

        def export_and_push():
            from megatron_pdm.convert.checkpoint import META_FILE
            from megatron_pdm.convert.export import export_to_hf

            with open(os.path.join(scratch, META_FILE), "w") as f:
                json.dump(self._meta(), f, indent=2)
            assets = os.path.join(self.load_dir or "", "hf_assets")
            if self.load_dir and os.path.isdir(assets):
                shutil.copytree(assets, os.path.join(scratch, "hf_assets"))
            if os.path.isdir(target):
                shutil.rmtree(target)
            export_to_hf(scratch, target, expert_layout="per_expert", dtype=self.export_dtype,
                         progress=False)
            shutil.rmtree(scratch, ignore_errors=True)
            rollout.client.update_weights_from_disk(target, str(version))
            self._cleanup(keep=target)
            return {"path": target}

        return rollout.on_rank0(export_and_push)

    def _cleanup(self, keep: str) -> None:
        keep_n = max(1, self.cfg.rollout.sglang.keep_synced)
        dirs = [d for d in os.listdir(self.root) if d.startswith("v") and d[1:].isdigit()]
        dirs.sort(key=lambda d: int(d[1:]))
        for d in dirs[:-keep_n]:
            path = os.path.join(self.root, d)
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)
