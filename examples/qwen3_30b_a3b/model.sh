#!/usr/bin/env bash
# Qwen3-30B-A3B architecture flags (megatron-style), sourced by train_pdm*.sh.
# Must agree with megatron_pdm.mcore.model.Qwen3MoeArch.qwen3_30b_a3b()
# (tests/unit/test_examples_qwen3_30b_a3b.py checks every value).
MODEL_ARGS=(
    --num-layers 48
    --hidden-size 2048
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 4
    --kv-channels 128
    --qk-layernorm
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-base 1000000
    --max-position-embeddings 40960
    --untie-embeddings-and-output-weights
    --vocab-size 151936
    --make-vocab-size-divisible-by 128
    --num-experts 128
    --moe-router-topk 8
    --moe-ffn-hidden-size 768
    --moe-router-score-function softmax
    --moe-router-dtype fp32
)
