"""megatron-pdm: Predictive Divergence Masks for Megatron-core RL, with an SGLang top-K bridge."""

from setuptools import find_packages, setup

# Pins are deliberate:
# - torch 2.13.0 is the CPU build CI runs on (GPU clusters bring their own CUDA torch build;
#   install with `pip install --no-deps -e .` there, or relax via the [gpu] extra's environment).
# - megatron-core 0.16.1 is the newest wheel for Python 3.11 and is what CI tests. The code also
#   follows the 0.19.x API (the range below); 0.17+ declares Python >= 3.12.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core>=0.16.1,<0.20",
    "psutil>=5.9",  # megatron-core dist-checkpointing needs it
    "numpy>=1.26",
    "pyyaml>=6.0",
    "orjson>=3.10",
    "pybase64>=1.3",
    "aiohttp>=3.9",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboard>=2.16",
    "safetensors>=0.4",
]

EXTRAS = {
    "test": [
        "pytest>=8.0",
        "hypothesis>=6.100",
        "transformers>=5.0,<6",
    ],
    # GPU-only packages: never imported on the CPU path.
    "gpu": [
        "transformer-engine[pytorch]>=2.8",
        "sglang>=0.5.20",
    ],
}

setup(
    name="megatron-pdm",
    version="0.1.0",
    description="Predictive Divergence Masks (PDM), DPPO, DRPO and GRPO trust regions as one "
    "vocab-parallel op for Megatron-core RL, with an SGLang top-K rollout bridge.",
    packages=find_packages(
        include=["megatron_pdm", "megatron_pdm.*", "rollout_bridge", "rollout_bridge.*"]
    ),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    include_package_data=True,
    package_data={"megatron_pdm": ["configs/*.yaml"]},
)
