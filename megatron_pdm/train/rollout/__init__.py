"""The driver's rollout side: where the trainer's batches come from and how its weights get back.

Reading order:

  factory.py     `build_rollout`: `rollout.engine` -> the run's rollout source
  local.py       `LocalRollout`: an engine copy of the policy on every rank (`LocalEngine` over
                 `GatheredGPT`), the `rollout.local.staleness` weight queue
  server.py      `ServerRollout`: rank 0 drives a server engine and broadcasts every batch;
                 background `submit` / `collect` for `rollout.overlap`
  sglang.py      `SGLangGlue`: the SGLang client and its disk or broadcast weight sync
  vllm.py        `VLLMGlue`: the vLLM client and its in-memory weight push
  feed.py        `sampling_params` (the one sampling-params dict) and `RolloutFeed` (the
                 iteration's batch; one generated ahead with `rollout.overlap`)
  store.py       saved rollout batches (`log.save_rollouts`) and the overlap batch in checkpoints
  config.py      the `rollout` config section (`RolloutConfig` and its per-engine sections)
  vllm_server/   the CPU vLLM launcher (`python -m megatron_pdm.train.rollout.vllm_server`)

The engines themselves (HTTP clients, the in-process engine, batch types) are `rollout_bridge`;
this package is the trainer's side of them. Modules import each other directly; this file
exports nothing.
"""
