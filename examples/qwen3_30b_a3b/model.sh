#!/usr/bin/env bash
# Qwen3-30B-A3B architecture, sourced by train_pdm.sh. Read from the one source,
# megatron_pdm/arch.py (ModelArch.qwen3_30b_a3b), never restated:
#   MODEL_SETS  the driver's --set model.<field>=value overrides (pdm.yaml holds no shape)
#   MODEL_ARGS  the same architecture as megatron-style flags, for the log
mapfile -t MODEL_SETS < <("${PYTHON:-python3}" -m megatron_pdm.arch qwen3-30b-a3b --format sets)
mapfile -t MODEL_ARGS < <("${PYTHON:-python3}" -m megatron_pdm.arch qwen3-30b-a3b --format flags)
((${#MODEL_SETS[@]} && ${#MODEL_ARGS[@]})) || {
    echo "model.sh: python -m megatron_pdm.arch failed" >&2; exit 2; }
