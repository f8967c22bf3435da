#!/usr/bin/env bash
# PDM RL on Qwen3-30B-A3B with megatron-core: multi-node torchrun, TP4 + SP, EP8.
# PRECISION=bf16 (the default): BF16 training and rollout weights. PRECISION=fp8: Transformer
#   Engine FP8 (e4m3, blockwise scaling) training and FP8 rollout weights; needs Hopper+ GPUs and
#   the TE spec (convert with --key-style te). train_pdm_fp8.sh runs this script with
#   PRECISION=fp8; its header has the FP8 memory figures.
#
# Hardware: NNODES x 8 GPUs with >= 80 GB each (H100/H200), NVLink inside a node, InfiniBand
#   between nodes; a separate pool of GPUs runs the SGLang rollout servers (launch_sglang.sh).
# Prerequisites:
#   1. megatron-core >= 0.16 with transformer-engine, this package installed on every node;
#   2. the HF checkpoint converted once (any layout; the dist checkpoint reshards on load):
#        python -m megatron_pdm.tools.convert_hf_to_megatron --hf-dir Qwen3-30B-A3B --out $MCORE_CKPT \
#            --tp 4 --ep 8 --key-style te
#      and verified: python -m megatron_pdm.tools.verify_conversion --hf-dir ... --megatron-dir $MCORE_CKPT
#      ($MCORE_CKPT is Megatron-LM's --load layout: release/ + latest_checkpointed_iteration.txt);
#   3. SGLang servers up at $SGLANG_URL serving the same weights (launch_sglang.sh, same
#      $PDM_SGLANG_API_KEY), able to reach $MASTER_ADDR (weight sync over NCCL), or, with
#      WEIGHT_SYNC=disk, to read $SYNC_DIR (shared file system);
#   4. prompts at $PROMPTS (JSONL, {"prompt": ..., "answer": ...}).
# Expected memory per GPU, as printed by `bash train_pdm.sh --dry-run` (megatron_pdm.layout;
#   TP4 EP8 PP1, bf16, distributed optimizer, full recompute,
#   8192-token samples, micro-batch = 512 samples / 4 minibatches / DP / 16 micro-batches; GiB, + CUDA/NCCL overhead):
#   world 16 (NNODES=2, DP4, micro-batch 2): weights 7.5, grads 15.0, optimizer 21.4, activations 1.3, logits 4.6 = 49.8 GiB
#   world 8 (NNODES=1, DP2, micro-batch 4): weights 7.5, grads 15.0, optimizer 42.7, activations 2.6, logits 9.3 = 77.1 GiB
#   (the transformer-engine layer spec, used whenever TE is importable: fused attention)
#   without transformer-engine the local spec keeps s x s attention scores: +12.0 GiB (world 16), +24.0 GiB (world 8)
# Check any layout first, on any machine (one process, no GPU, report on this console):
#   NNODES=2 TP=4 EP=8 bash train_pdm.sh --dry-run
# See the driver's arguments without running anything (no GPU, no torchrun, no checks):
#   bash train_pdm.sh --print-args     (one per line, as passed to python -m megatron_pdm.train)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${HERE}/model.sh"
# this node's first non-loopback address (the default MASTER_ADDR of a one-node run)
node_address() {
    local addr
    addr="$( { hostname -I 2>/dev/null || true; } | tr " " "\n" | grep -v -e "^127\." -e "^$" | head -n 1 || true)"
    echo "${addr:-$(hostname)}"
}

NNODES="${NNODES:-2}"
NODE_RANK="${NODE_RANK:-0}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR_GIVEN="${MASTER_ADDR:-}"
MASTER_ADDR="${MASTER_ADDR:-$(node_address)}"
MASTER_PORT="${MASTER_PORT:-29500}"
TP="${TP:-4}"
EP="${EP:-8}"
PP="${PP:-1}"
MCORE_CKPT="${MCORE_CKPT:-/checkpoints/qwen3-30b-a3b-mcore}"
HF_CKPT="${HF_CKPT:-/checkpoints/Qwen3-30B-A3B}"
SYNC_DIR="${SYNC_DIR:-/checkpoints/qwen3-30b-a3b-pdm-sync}"
PROMPTS="${PROMPTS:-/data/prompts.jsonl}"
SGLANG_URL="${SGLANG_URL:-http://127.0.0.1:30000}"
WEIGHT_SYNC="${WEIGHT_SYNC:-distributed}"
SEQ_LENGTH="${SEQ_LENGTH:-8192}"
PRECISION="${PRECISION:-bf16}"  # bf16 | fp8 (selects PRECISION_ARGS below)
LOG_DIR="${LOG_DIR:-runs/qwen3_30b_a3b_pdm.logs}"  # beside output_dir (a fresh start moves output_dir aside)

# torchrun rendezvous: one process per GPU
DISTRIBUTED_ARGS=(
    --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}"
    --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}"
    --log-dir "${LOG_DIR}" --tee 3 --local-ranks-filter 0
)
# parallel layout (sequence parallelism is switched on by the driver whenever TP > 1; ETP = 1)
PARALLEL_ARGS=(
    --set "parallel.tp=${TP}" --set "parallel.ep=${EP}" --set "parallel.pp=${PP}"
    --set parallel.use_distributed_optimizer=true
)
case "${PRECISION}" in
    # BF16 weights/activations, fp32 grads and Adam state, BF16 rollout weights
    bf16) PRECISION_ARGS=(
        --set precision.params_dtype=bf16 --set rollout.rollout_precision=bf16
    ) ;;
    # TE FP8 e4m3 with blockwise (128x128) scaling for the linear layers, BF16 elsewhere, fp32
    # grads and Adam state; rollout weights quantised to FP8 (blockwise) at every push (TE reads
    # NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 from the environment for FP32 block scales)
    fp8) PRECISION_ARGS=(
        --set precision.params_dtype=bf16 --set precision.fp8=e4m3 --set precision.fp8_recipe=blockwise
        --set rollout.rollout_precision=fp8
    ) ;;
    *) echo "PRECISION=${PRECISION}: give bf16 or fp8" >&2; exit 2 ;;
esac
# checkpoint in/out (dist checkpoint written by megatron_pdm/tools/convert_hf_to_megatron.py)
CHECKPOINT_ARGS=(
    --set "checkpoint.load_dir=${MCORE_CKPT}" --set checkpoint.save_interval=20
)
# rollout: SGLang servers holding the same model, top-K logprobs returned for the PDM mask
ROLLOUT_ARGS=(
# weight sync without disk (WEIGHT_SYNC=distributed): trainer rank 0 (on MASTER_ADDR, which every
# server must reach) gathers the live model and broadcasts it to the servers over NCCL;
# WEIGHT_SYNC=disk writes HF safetensors to SYNC_DIR/v<N> (readable by the servers) instead.
# The servers' API key is read from $PDM_SGLANG_API_KEY (the same value launch_sglang.sh uses).
    --set rollout.engine=sglang --set "rollout.sglang.url=${SGLANG_URL}"
    --set "rollout.sglang.weight_sync.mode=${WEIGHT_SYNC}"
    --set rollout.sglang.weight_sync.backend=nccl
    --set "rollout.sglang.weight_sync.master_addr=${MASTER_ADDR}"
    --set "rollout.sglang.hf_checkpoint=${SYNC_DIR}"
    --set "rollout.max_sequence_length=${SEQ_LENGTH}"
)
# data: JSONL prompts {"prompt", "answer"}, tokenized with the HF checkpoint's tokenizer
DATA_ARGS=(
    --set task.name=jsonl --set "task.path=${PROMPTS}" --set "task.tokenizer_dir=${HF_CKPT}"
)
# PDM loss (preset and knobs in pdm.yaml)
LOSS_ARGS=(
    --set loss.preset=pdm-agg
)
# memory: full activation recomputation
MEMORY_ARGS=(
    --set train.recompute=full
)

RUN_ARGS=(
    --config "${HERE}/pdm.yaml" "${MODEL_SETS[@]}"
    "${PARALLEL_ARGS[@]}" "${PRECISION_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
    "${ROLLOUT_ARGS[@]}" "${DATA_ARGS[@]}" "${LOSS_ARGS[@]}" "${MEMORY_ARGS[@]}"
)
# --print-args: the driver's arguments, one per line, then stop (before any GPU, NCCL, MASTER_ADDR
# check, torchrun or dry-run): what tests/train/test_driver_config.py reads
for arg in "$@"; do
    if [[ "${arg}" == "--print-args" ]]; then
        printf '%s\n' "${RUN_ARGS[@]}"
        for other in "$@"; do [[ "${other}" == "--print-args" ]] || printf '%s\n' "${other}"; done
        exit 0
    fi
done

# environment Megatron and TE read: CUDA_DEVICE_MAX_CONNECTIONS=1 keeps the TP/SP collectives
# ordered ahead of the GEMMs they overlap with (megatron/core/tensor_parallel/layers.py warns
# without it under sequence parallelism; distributed_data_parallel.py relies on it for overlap)
export CUDA_DEVICE_MAX_CONNECTIONS=1
FP8_RECIPE=""
for arg in "${PRECISION_ARGS[@]}"; do
    [[ "${arg}" == precision.fp8_recipe=* ]] && FP8_RECIPE="${arg#*=}"
done
if [[ " ${PRECISION_ARGS[*]} " == *" precision.fp8=e4m3 "* || " ${PRECISION_ARGS[*]} " == *" precision.fp8=hybrid "* ]]; then
    # blockwise on Hopper: FP32 (not power-of-2) block scales, the layout the rollout quantiser
    # writes; TE's blockwise emulation on Blackwell needs power-of-2 scales (set it to 0 there)
    if [[ "${FP8_RECIPE}" == "blockwise" ]]; then
        export NVTE_FP8_BLOCK_SCALING_FP32_SCALES="${NVTE_FP8_BLOCK_SCALING_FP32_SCALES:-1}"
    fi
    # refuse a recipe this node's GPU or torch build cannot run, before any rendezvous
    # (megatron_pdm.mcore.fp8.check_fp8_recipe: TE's support rules, the one the driver applies too)
    if [[ -z "${SKIP_GPU_CHECKS:-}" ]] && ! [[ " $* " == *" --dry-run "* ]]; then
        FP8_RECIPE="${FP8_RECIPE}" "${PYTHON:-python3}" - <<'PY' || exit 2
import os, sys
import torch
from megatron_pdm.mcore.fp8 import check_fp8_recipe
recipe = os.environ["FP8_RECIPE"]
if not torch.cuda.is_available():
    sys.exit(f"FP8 recipe {recipe}: no CUDA device on this node")
try:
    check_fp8_recipe(recipe, torch.cuda.get_device_capability(), torch.version.cuda)
except (RuntimeError, ValueError) as err:
    sys.exit(str(err))
PY
    fi
fi
# NCCL: trainer and SGLang servers must run the same NCCL version (the weight-update group
# aborts otherwise). Printed here; launch_sglang.sh prints the servers' (compare the two logs).
# With SGLANG_PYTHON (the servers' python, reachable on this node) the two are compared here.
if ! [[ " $* " == *" --dry-run "* ]]; then
    NCCL_TRAINER="$("${PYTHON:-python3}" -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>/dev/null || echo unknown)"
    echo "NCCL (trainer torch): ${NCCL_TRAINER}"
    if [[ -n "${SGLANG_PYTHON:-}" ]]; then
        NCCL_SGLANG="$("${SGLANG_PYTHON}" -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>/dev/null || echo unknown)"
        if [[ "${NCCL_SGLANG}" != "${NCCL_TRAINER}" ]]; then
            echo "NCCL mismatch: trainer ${NCCL_TRAINER}, SGLang (${SGLANG_PYTHON}) ${NCCL_SGLANG}" >&2
            exit 2
        fi
    fi
    # MASTER_ADDR: the address every other node and every SGLang server reaches (weight sync)
    if [[ -z "${MASTER_ADDR_GIVEN}" ]] && ((NNODES > 1)); then
        echo "set MASTER_ADDR to node 0's address (reachable by every node and SGLang server)" >&2
        exit 2
    fi
    if [[ "${MASTER_ADDR}" == 127.* || "${MASTER_ADDR}" == localhost ]] && ((NNODES > 1)); then
        echo "MASTER_ADDR=${MASTER_ADDR} is loopback: other nodes and SGLang servers cannot reach it" >&2
        exit 2
    fi
fi

# the architecture reaches the driver as MODEL_SETS (checked against $MCORE_CKPT/pdm_model.json at
# start); the same values as megatron-style flags, for the log
echo "model: ${MODEL_ARGS[*]}"

# --dry-run: no torchrun, no GPU, no rendezvous. One process on this machine checks the layout of
# the whole job (WORLD_SIZE = NNODES x GPUS_PER_NODE) and prints the per-GPU memory estimate here.
for arg in "$@"; do
    if [[ "${arg}" == "--dry-run" ]]; then
        WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) RANK=0 exec "${PYTHON:-python3}" \
            -m megatron_pdm.train "${RUN_ARGS[@]}" "$@"
    fi
done

# rank 0's output is shown here and every rank's is kept in ${LOG_DIR}
torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_pdm.train "${RUN_ARGS[@]}" "$@"
