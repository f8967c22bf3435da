#!/usr/bin/env bash
# SGLang rollout servers for PDM on Qwen3-30B-A3B, matching the trainer's model settings.
#
# Hardware: one 8-GPU node per server (ENGINES servers on consecutive ports).
# Prerequisites: sglang 0.5.22-0.5.23 installed; the BF16 HF checkpoint. ROLLOUT_PRECISION=fp8
#   adds --quantization fp8: SGLang quantises the BF16 weights on load (and on every weight
#   update) with one scale per tensor (per expert), which is what the trainer's local simulation
#   does with rollout.local.fp8_scales=tensor (the default). An FP8 checkpoint (Qwen3-30B-A3B-FP8)
#   carries 128x128 block scales instead (rollout.local.fp8_scales=block128).
#   Weights are refreshed by the trainer each iteration (train_pdm.sh WEIGHT_SYNC).
# Access: the weight-update and pause routes let whoever reaches a server replace the policy.
#   Every server requires PDM_SGLANG_API_KEY (the trainer sends it) and binds to HOST
#   (default loopback; set it to this node's private interface, never a public one).
# The key never reaches a command line or a log: sglang 0.5.22-0.5.23 has no environment variable
#   for it, so it goes into a YAML file read by `--config` (mode 600, removed when this script
#   exits; sglang merges it into its arguments in-process, so `ps` shows only the file's path);
#   sglang logs its whole `server_args` (api_key included) at INFO (sglang/srt/entrypoints/engine.py),
#   so every server's output passes through a filter that replaces the key with <redacted>.
# The trainer sends token ids (no tokenizer on the server: --skip-tokenizer-init) and asks for
#   top-K logprobs (rollout.top_logprobs in pdm.yaml), so the returned logprobs are over the full vocab.
set -euo pipefail

HF_CKPT="${HF_CKPT:-/checkpoints/Qwen3-30B-A3B}"
ENGINES="${ENGINES:-1}"
BASE_PORT="${BASE_PORT:-30000}"
SGLANG_TP="${SGLANG_TP:-8}"
SGLANG_EP="${SGLANG_EP:-8}"
CONTEXT_LENGTH="${CONTEXT_LENGTH:-8192}"
ROLLOUT_PRECISION="${ROLLOUT_PRECISION:-bf16}"
LOG_DIR="${LOG_DIR:-runs/qwen3_30b_a3b_pdm.sglang}"  # beside the trainer output_dir
HOST="${HOST:-127.0.0.1}"
: "${PDM_SGLANG_API_KEY:?set PDM_SGLANG_API_KEY (the servers refuse every request without it)}"
mkdir -p "${LOG_DIR}"

# the key, out of argv: a private YAML file for sglang's --config (removed on exit)
KEY_DIR="$(mktemp -d)"
chmod 700 "${KEY_DIR}"
KEY_FILE="${KEY_DIR}/api_key.yaml"
(umask 077 && PYTHONPATH= python -c 'import json, os
print("api-key: " + json.dumps(os.environ["PDM_SGLANG_API_KEY"]))' > "${KEY_FILE}")
# the key, out of the logs: every line of server output with the key replaced
redact() {
    PYTHONPATH= python -u -c 'import os, sys
key = os.environ["PDM_SGLANG_API_KEY"]
for line in sys.stdin:
    sys.stdout.write(line.replace(key, "<redacted>"))
    sys.stdout.flush()'
}

# model and parallelism: same architecture as model.sh; experts spread over EP ranks
MODEL_ARGS=(
    --model-path "${HF_CKPT}" --tp-size "${SGLANG_TP}" --ep-size "${SGLANG_EP}"
    --context-length "${CONTEXT_LENGTH}" --dtype bfloat16
)
# precision: FP8 rollout weights (online per-tensor e4m3) when the trainer uses rollout_precision=fp8
PRECISION_ARGS=()
if [[ "${ROLLOUT_PRECISION}" == "fp8" ]]; then
    PRECISION_ARGS=(--quantization fp8)
fi
# RL serving: token ids in/out, weight updates from the trainer, deterministic sampling seeds
SERVING_ARGS=(
    --skip-tokenizer-init --mem-fraction-static 0.8 --enable-deterministic-inference
)

# NCCL: the trainer's weight-update group needs the same NCCL as these servers; the trainer script
# prints its own version, compare the two lines (docs/cluster.md)
echo "SGLang NCCL: $(PYTHONPATH= python -c 'import torch; v = torch.cuda.nccl.version(); print(".".join(map(str, v)) if isinstance(v, tuple) else v)' 2>/dev/null || echo unknown)"

pids=()
for ((i = 0; i < ENGINES; i++)); do
    port=$((BASE_PORT + i))
    python -m sglang.launch_server "${MODEL_ARGS[@]}" "${PRECISION_ARGS[@]}" \
        "${SERVING_ARGS[@]}" --config "${KEY_FILE}" --host "${HOST}" --port "${port}" \
        > >(redact > "${LOG_DIR}/server_${port}.log") 2>&1 &
    pids+=("$!")
    echo "SGLang server ${i}: http://${HOST}:${port} (pid $!)"
done
# stop only the servers started here, by pid
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
trap 'rm -rf "${KEY_DIR}"' EXIT
wait "${pids[@]}"
wait  # the log filters (process substitutions) flush before exit
