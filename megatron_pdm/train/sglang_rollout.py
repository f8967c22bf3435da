"""Rollouts from SGLang servers and the weight sync that keeps them on-policy (`engine: sglang`).

Rollout: global rank 0 sends the iteration's prompts to `rollout_bridge.SGLangEngine`
(`rollout.sglang_url`; token ids in, top-K logprobs out); the rank-0 driving, the version check
and the broadcast to every rank are `ServerRollout`'s (server_rollout.py).

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

import torch.distributed as dist

from megatron_pdm.train.server_rollout import ServerRollout

logger = logging.getLogger(__name__)


class SGLangRollout(ServerRollout):
    """Rank 0 talks to SGLang; every rank receives the same `RolloutBatch` (server_rollout.py)."""

    def __init__(self, cfg, arch, trainer_module_fn, *, meta: dict | None, style: str):
        r = cfg.rollout
        self.style = style
        self.root = os.path.abspath(r.hf_checkpoint)
        self.meta_base = meta or {}
        self.load_dir = cfg.checkpoint.load_dir
        if r.rollout_precision in ("bf16", "fp8"):
            self.export_dtype = "bf16"
        else:
            self.export_dtype = cfg.precision.params_dtype
        super().__init__(cfg, arch, trainer_module_fn)

    def _make_client(self):
        from rollout_bridge import SGLangEngine

        r = self.cfg.rollout
        os.makedirs(self.root, exist_ok=True)
        return SGLangEngine(
            r.sglang_url, top_logprobs=r.top_logprobs, timeout_s=r.timeout_s,
            max_retries=r.max_retries, seed=self.cfg.seed, vocab_size=self.arch.vocab_size,
            raise_on_failure=True, topk_transport=r.topk_transport)

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

    def _push(self, version: str) -> None:
        """Collective: export the current weights and push them to the servers as `version`."""
        from megatron_pdm.mcore.checkpoint import save_model

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

    def _cleanup(self, keep: str) -> None:
        keep_n = max(1, self.cfg.rollout.keep_synced)
        dirs = [d for d in os.listdir(self.root) if d.startswith("v") and d[1:].isdigit()]
        dirs.sort(key=lambda d: int(d[1:]))
        for d in dirs[:-keep_n]:
            path = os.path.join(self.root, d)
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)
