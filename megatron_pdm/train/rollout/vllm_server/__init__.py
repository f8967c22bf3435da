"""Start and stop a CPU vLLM server for a run config (tests, `make demo-vllm`, benchmarks).

What: `prepare_model_dir` writes an HF Qwen3-MoE directory (config.json + random safetensors) of
the run's architecture (`model` section, vocabulary from the task), so vLLM serves exactly the
network the trainer trains; the trainer then pushes its own weights before the first rollout
(`rollout.sync_at_start`), so the random start weights never produce a rollout. `VLLMServer`
runs vLLM's OpenAI-compatible server (`.venv-vllm`, scripts/setup_vllm_cpu.sh), after checking
that environment's vLLM release against the supported range (`installed_vllm_version`,
rollout_bridge/vllm/versions.py), with the flags the bridge needs (docs/engines.md, vLLM):

  --logprobs-mode processed_logprobs   returned log-probs are log_softmax(logits / T)
  --skip-tokenizer-init                token ids in and out, no tokenizer needed
  --no-enable-chunked-prefill          per-request seeds (vLLM refuses seeds with it on CPU)
  --enforce-eager                      no torch.compile: 11-27 s less start-up, not slower here
  --generation-config vllm             ignore a model's generation_config.json sampling defaults
  --worker-extension-cls / --middleware   weight sync over /collective_rpc, and the API key
                                       required on every route (vLLM's --api-key guards /v1 only)

Security: the server binds 127.0.0.1 unless `host` names a private (RFC 1918 / ULA) address;
dev mode (`VLLM_SERVER_DEV_MODE=1`, needed for /collective_rpc, /pause, /update_weight_version)
lets whoever reaches the port run worker methods, so the key is required everywhere by
`BearerAuthEverywhereMiddleware` and comes from the environment (`VLLM_API_KEY`, never the
command line, which `ps` shows).

Process hygiene (process.py): the server runs in its own process group, and `stop()` ends the
whole group, never processes by name.

Modules, one job each: venv.py (where the vLLM environment is, its vLLM release), model_dir.py
(the HF directory of a run's architecture), process.py (`VLLMServer`: the process group, start,
health, stop), cli.py (`python -m megatron_pdm.train.rollout.vllm_server`, the
`megatron-pdm-vllm-server` console command; __main__.py runs it).
"""
