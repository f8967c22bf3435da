"""The RL driver: `python -m megatron_pdm.train --config ...` (launched by torchrun).

Modules: config (run config), task (toy task + tokenizer), rollout (engine copy + LocalEngine),
trainer (the loop), logging_utils (jsonl/TensorBoard/progress), report (plot + summary),
compare (presets x seeds), dry_run (layout check without allocating the model).
"""
