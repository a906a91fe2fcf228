"""megatron_rollout: in-place P/D multiplexed rollouts for Megatron-core MoE RL."""
from setuptools import find_packages, setup

setup(
    name="megatron_rollout",
    version="0.1.0",
    description="Rollout engine embedded in Megatron-core trainers: multiplexed prefill/decode for MoE RL",
    packages=find_packages(include=["megatron_rollout", "megatron_rollout.*", "rl", "rl.*"]),
    package_data={"megatron_rollout": ["csrc/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.9",
        "megatron-core>=0.16",
        "safetensors",
        "tqdm",
        "pyyaml",
        "numpy",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "transformers>=4.51"],
        "hf": ["transformers>=4.51"],
    },
    entry_points={"console_scripts": ["megatron-rollout=megatron_rollout.cli:main"]},
)
