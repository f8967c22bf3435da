"""`--save-warmup DIR`: run only the supervised warm-up and save its weights for later RL runs.

The weights go to DIR in the converter's layout (Megatron-LM release checkpoint + pdm_model.json,
convert/load_dir.py), so `--set checkpoint.load_dir=DIR --set warmup.steps=0` starts RL from them
at any TP/EP/PP. `warmup.json` beside them records the warm-up's evaluations and the config that
produced it. `megatron_pdm.train.compare` runs the warm-up once this way and shares it between
all its runs instead of repeating it per run.
"""

from __future__ import annotations

import json
import os
import time

WARMUP_FILE = "warmup.json"


def save_warmup(cfg, out_dir: str) -> dict:
    """Collective (under torchrun): warm-up of `cfg`, then the checkpoint in `out_dir`."""
    import torch.distributed as dist

    from megatron_pdm.convert.checkpoint import save_release
    from megatron_pdm.train import model_setup as ms
    from megatron_pdm.train.logging_utils import is_rank0, log_rank0
    from megatron_pdm.train.trainer import Trainer

    if cfg.warmup.steps == 0:
        raise ValueError("--save-warmup needs warmup.steps > 0")
    start = time.time()
    trainer = Trainer(cfg)
    trainer.sync_weights()
    trainer.evaluate("before_warmup")
    trainer.warmup()
    trainer.sync_weights()
    trainer.evaluate("before_rl")
    p = cfg.parallel
    style = ms.key_style(cfg)
    meta = {
        "format": "megatron-core dist_checkpointing torch_dist",
        "arch": trainer.arch.to_dict(),
        "layout_at_import": {"tp": p.tp, "ep": p.ep, "pp": p.pp, "etp": 1},
        "params_dtype": cfg.precision.params_dtype,
        "key_style": style,
        "source": {"warmup_of": cfg.output_dir, "expert_layout": "per_expert",
                   "dtype": cfg.precision.params_dtype},
        "hf_config": None,
    }
    save_release(trainer.module, out_dir, meta, key_style=style, model_style=style)
    record = {"evals": trainer.evals, "wall_s": time.time() - start, "config": cfg.to_dict()}
    if is_rank0():
        with open(os.path.join(out_dir, WARMUP_FILE), "w") as f:
            json.dump(record, f, indent=1)
        log_rank0("saved the warm-up's weights to %s (%.0f s)", out_dir, record["wall_s"])
    dist.barrier()
    return record
