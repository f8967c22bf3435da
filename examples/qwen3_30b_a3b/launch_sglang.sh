#!/usr/bin/env bash
# SGLang rollout servers for PDM on Qwen3-30B-A3B, matching the trainer's model settings.
#
# Hardware: one 8-GPU node per server (ENGINES servers on consecutive ports).
# Prerequisites: sglang installed; the HF checkpoint (BF16, or FP8 blockwise for FP8 rollout
#   with ROLLOUT_PRECISION=fp8: pass the Qwen3-30B-A3B-FP8 directory, or run with
#   --quantization fp8 to quantise on load). Weights are refreshed by the trainer each iteration.
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
LOG_DIR="${LOG_DIR:-runs/qwen3_30b_a3b_pdm/sglang}"
mkdir -p "${LOG_DIR}"

# model and parallelism: same architecture as model.sh; experts spread over EP ranks
MODEL_ARGS=(
    --model-path "${HF_CKPT}" --tp-size "${SGLANG_TP}" --ep-size "${SGLANG_EP}"
    --context-length "${CONTEXT_LENGTH}" --dtype bfloat16
)
# precision: FP8 rollout weights (blockwise e4m3) when the trainer uses rollout_precision=fp8
PRECISION_ARGS=()
if [[ "${ROLLOUT_PRECISION}" == "fp8" ]]; then
    PRECISION_ARGS=(--quantization fp8)
fi
# RL serving: token ids in/out, weight updates from the trainer, deterministic sampling seeds
SERVING_ARGS=(
    --skip-tokenizer-init --mem-fraction-static 0.8 --enable-deterministic-inference
)

pids=()
for ((i = 0; i < ENGINES; i++)); do
    port=$((BASE_PORT + i))
    python -m sglang.launch_server "${MODEL_ARGS[@]}" "${PRECISION_ARGS[@]}" \
        "${SERVING_ARGS[@]}" --host 0.0.0.0 --port "${port}" \
        > "${LOG_DIR}/server_${port}.log" 2>&1 &
    pids+=("$!")
    echo "SGLang server ${i}: http://$(hostname):${port} (pid $!)"
done
# stop only the servers started here, by pid
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
wait "${pids[@]}"
