"""agentgym-jax: multi-turn RL for LLM agents on JAX/TPU."""

from setuptools import find_packages, setup

TEST = [
    "torch==2.13.0", "accelerate", "playwright", "nbclient", "nbformat", "ipykernel", "psutil",
    "pytest", "hypothesis", "wandb", "peft"
]

setup(
    name="agentgym-jax", version="0.1.0",
    description="JAX/TPU-native multi-turn reinforcement learning for LLM agents (AgentGym-RL).",
    python_requires=">=3.10",
    packages=find_packages(include=["agentgym_jax*", "environments*"]) + ["agentgym_jax.configs"],
    package_dir={"agentgym_jax.configs": "configs"},
    package_data={
        "environments": ["**/*.json", "**/*.txt"],
        "agentgym_jax": ["tools/viewer.html", "tools/viewer.css", "tools/viewer.js"]
    }, install_requires=[
        "jax", "flax>=0.12", "optax", "orbax-checkpoint", "etils[epath]", "transformers",
        "tokenizers", "sentencepiece", "jinja2", "safetensors", "ml-collections", "absl-py",
        "tensorstore", "gguf", "numpy", "tensorboardX", "tqdm", "matplotlib", "minecraft-data",
        "bm25s", "minigrid", "scienceworld"
    ], extras_require={
        "test": TEST,
        "searchqa": ["pyarrow", "faiss-cpu"],
        "webarena": ["playwright"],
        "tpu": ["jax[tpu]"],
        "gpu": ["jax[cuda12]"],
        "gcs": ["gcsfs", "google-cloud-storage"],
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
    })
