#!/usr/bin/env bash
# Qwen3-30B-A3B architecture as megatron-style flags, sourced by train_pdm*.sh for the log.
# Read from the one source, megatron_pdm/arch.py (Qwen3MoeArch.qwen3_30b_a3b), never restated.
mapfile -t MODEL_ARGS < <("${PYTHON:-python3}" -m megatron_pdm.arch qwen3-30b-a3b --format flags)
((${#MODEL_ARGS[@]})) || { echo "model.sh: python -m megatron_pdm.arch failed" >&2; exit 2; }
