"""The RL driver: `python -m megatron_pdm.train --config ...` (launched by torchrun).

Modules: config (run config), task (toy task + tokenizer), rollout/ (the rollout side: engine
factory, local and server rollouts, overlap, rollout config, vLLM launcher), trainer (the loop),
logging_utils (jsonl/TensorBoard/progress), report (plot + summary), compare (presets x seeds),
dry_run (layout check without allocating the model).
"""
