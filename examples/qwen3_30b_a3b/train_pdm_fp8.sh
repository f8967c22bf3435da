#!/usr/bin/env bash
# PDM RL on Qwen3-30B-A3B with megatron-core: multi-node torchrun, Transformer Engine FP8
# (e4m3, blockwise scaling) training and FP8 rollout weights, TP4 + SP, EP8.
# train_pdm.sh with PRECISION=fp8 (everything else, the prerequisites and the environment
# variables, is that script's); needs Hopper+ GPUs and the TE spec (convert with --key-style te).
# Memory: weights + 1 byte/param FP8 copy (see examples/qwen3_30b_a3b/README.md).
# Expected memory per GPU, as printed by `bash train_pdm_fp8.sh --dry-run` (megatron_pdm.layout;
#   TP4 EP8 PP1, bf16 + FP8 copies of the linear weights, distributed optimizer, full recompute,
#   8192-token samples, micro-batch = 512 samples / 4 minibatches / DP / 16 micro-batches; GiB, + CUDA/NCCL overhead):
#   world 16 (NNODES=2, DP4, micro-batch 2): weights 11.1, grads 15.0, optimizer 21.4, activations 1.3, logits 4.6 = 53.4 GiB
#   world 8 (NNODES=1, DP2, micro-batch 4): weights 11.1, grads 15.0, optimizer 42.7, activations 2.6, logits 9.3 = 80.7 GiB
#   (one node needs GPUs larger than 80 GB, e.g. H200, or more micro-batches: the dry-run shows it)
# Check any layout first, on any machine (one process, no GPU, report on this console):
#   NNODES=2 TP=4 EP=8 bash train_pdm_fp8.sh --dry-run
PRECISION=fp8 exec bash "$(dirname "$0")/train_pdm.sh" "$@"
