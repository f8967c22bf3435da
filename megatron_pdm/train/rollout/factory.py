"""The run's rollout source, picked by `rollout.engine`: the one place that knows every engine.

"local" builds the engine copy of the policy on every rank (local.py: `LocalRollout`); "sglang"
and "vllm" build a `ServerRollout` whose rank 0 drives a server (server.py), composed with the
engine's glue (sglang.py `SGLangGlue` / vllm.py `VLLMGlue`).
Every source offers `generate(prompt_ids, params, n)`, `sync(version)` and
`state_dict` / `load_state_dict`; the server ones also `submit` / `collect` (rollout.overlap,
overlap.py).
"""

from __future__ import annotations

from megatron_pdm.mcore.device import place
from megatron_pdm.train.rollout.local import LocalRollout, build_engine


def build_rollout(cfg, arch, tconfig, task, trainer_module_fn, *, meta: dict | None):
    """The run's rollout source: `LocalRollout` (engine copy on every rank) or a `ServerRollout`
    (a server driven by rank 0) composed with `SGLangGlue` or `VLLMGlue`."""
    from megatron_pdm.train import model_setup as ms

    r = cfg.rollout
    if r.engine in ("sglang", "vllm"):
        from megatron_pdm.train.rollout.server import ServerRollout

        if r.engine == "sglang":
            from megatron_pdm.train.rollout.sglang import SGLangGlue

            glue = SGLangGlue(cfg, arch, meta=meta, style=ms.key_style(cfg))
        else:
            from megatron_pdm.train.rollout.vllm import VLLMGlue

            glue = VLLMGlue(cfg, arch)
        return ServerRollout(cfg, arch, trainer_module_fn, glue)
    from megatron_pdm.mcore.model import build_model

    rollout_gpt = place(build_model(arch, tconfig, use_te=ms.use_te(cfg)))
    engine = build_engine(rollout_gpt, vocab_size=arch.vocab_size, top_logprobs=r.top_logprobs,
                          seed=cfg.seed, rollout_precision=r.rollout_precision,
                          eos_id=task.eos_id, pad_id=task.pad_id, tp_size=cfg.parallel.tp,
                          fp8_block_size=None if r.local.fp8_scales == "tensor" else 128)
    return LocalRollout(engine, trainer_module_fn, staleness=r.local.staleness)
