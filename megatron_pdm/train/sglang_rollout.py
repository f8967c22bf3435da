"""Rollouts from SGLang servers and the weight sync that keeps them on-policy (`engine: sglang`).

Rollout: global rank 0 sends the iteration's prompts to `rollout_bridge.SGLangEngine`
(`rollout.sglang_url`; token ids in, top-K logprobs out), checks that every sample was generated
by the weight version the trainer last pushed (`check_weight_version`: a stale rollout is an
error, never silently trained on) and broadcasts the `RolloutBatch` to every rank
(`broadcast_object_list`); each data-parallel rank then trains on its slice. A failure on rank 0
is broadcast too, so every rank raises instead of hanging in the next collective.

Weight sync (after each iteration's optimizer steps, and once before the first rollout):
1. every rank saves its model shard with megatron `dist_checkpointing` into a scratch directory
   (`<hf_checkpoint>/.dist_v<version>`, with a `pdm_model.json`), which works at any TP/EP/PP;
2. rank 0 streams it to HF safetensors with `megatron_pdm.convert.export.export_to_hf`
   (per-expert layout, one layer in memory at a time) into `<hf_checkpoint>/v<version>`;
3. rank 0 calls `SGLangEngine.update_weights_from_disk(path, version)`: pause -> update ->
   continue, then verifies /get_weight_version. Older version directories beyond
   `rollout.keep_synced` are deleted.
Cost per sync: the model is written twice and read once (dist shard write by all ranks in
parallel, then a single-process read + safetensors write on rank 0): for Qwen3-30B-A3B in bf16
about 3 x 61 GB of file I/O per iteration, i.e. minutes on a shared file system, dominated by
rank 0's export. The export dtype is bf16 for rollout_precision bf16/fp8 (fp8: the servers
quantise on load, `--quantization fp8`), else the training dtype. A production system would
broadcast the gathered tensors over NCCL instead (`SGLangEngine.update_weights_from_distributed`,
docs/engines.md); that path is not wired into the driver.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import torch.distributed as dist

from rollout_bridge.types import RolloutBatch, check_weight_version

logger = logging.getLogger(__name__)


class SGLangRollout:
    """Rank 0 talks to SGLang; every rank receives the same `RolloutBatch`."""

    def __init__(self, cfg, arch, trainer_module_fn, *, meta: dict | None, style: str):
        r = cfg.rollout
        self.cfg = cfg
        self.arch = arch
        self._module = trainer_module_fn
        self.style = style
        self.root = os.path.abspath(r.hf_checkpoint)
        self.meta_base = meta or {}
        self.load_dir = cfg.checkpoint.load_dir
        self.version: str | None = None
        self.last_sync_s = 0.0
        if r.rollout_precision in ("bf16", "fp8"):
            self.export_dtype = "bf16"
        else:
            self.export_dtype = cfg.precision.params_dtype
        self.client = None
        if dist.get_rank() == 0:
            from rollout_bridge import SGLangEngine

            os.makedirs(self.root, exist_ok=True)
            self.client = SGLangEngine(
                r.sglang_url, top_logprobs=r.top_logprobs, timeout_s=r.timeout_s,
                max_retries=r.max_retries,
                seed=cfg.seed, vocab_size=arch.vocab_size, raise_on_failure=True,
                topk_transport=r.topk_transport)
        self._on_rank0(lambda: self.client.check_server())

    # ------------------------------------------------------------------ helpers

    def _on_rank0(self, fn):
        """Runs fn on rank 0 and broadcasts its result (or its exception) to every rank."""
        box = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
                logger.exception("rank 0 SGLang call failed")
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise RuntimeError(f"SGLang rollout/sync failed on rank 0: {value}")
        return value

    # ------------------------------------------------------------------ rollouts

    def generate(self, prompt_ids: list[list[int]], params: dict, n: int) -> RolloutBatch:
        def run():
            batch = self.client.generate(prompt_ids, params, n=n)
            if self.version is not None:
                check_weight_version(batch, self.version)
            return batch

        return self._on_rank0(run)

    # ------------------------------------------------------------------ weight sync

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

    def sync(self, version: str) -> None:
        """Collective: export the current weights and push them to the servers as `version`."""
        from megatron_pdm.mcore.checkpoint import save_model

        t0 = time.time()
        scratch = os.path.join(self.root, f".dist_v{version}")
        target = os.path.join(self.root, f"v{version}")
        if dist.get_rank() == 0 and os.path.isdir(scratch):
            shutil.rmtree(scratch)
        save_model(scratch, self._module())

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
            self.client.update_weights_from_disk(target, str(version))
            self._cleanup(keep=target)
            return True

        self._on_rank0(export_and_push)
        self.version = str(version)
        self.last_sync_s = time.time() - t0
        logger.info("weight sync to version %s: %.2f s", version, self.last_sync_s)

    def _cleanup(self, keep: str) -> None:
        keep_n = max(1, self.cfg.rollout.keep_synced)
        dirs = [d for d in os.listdir(self.root) if d.startswith("v") and d[1:].isdigit()]
        dirs.sort(key=lambda d: int(d[1:]))
        for d in dirs[:-keep_n]:
            path = os.path.join(self.root, d)
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        # After a resume the trainer pushes its restored weights again (same version string).
        self.version = state.get("version")
