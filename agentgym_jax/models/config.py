"""The decoder's architecture description, read from and written to Hugging Face config.json.

One `ModelConfig` covers the three families we load:
  Qwen2 / Qwen2.5: q/k/v biases, rope theta 1e6, tied (small sizes) or untied embeddings.
  Qwen3:           per-head RMSNorm on q and k, no biases, explicit head_dim.
  Llama family:    no biases; SmolLM2 ties its embeddings; Llama 3.x rope scaling.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture hyper-parameters of a decoder-only transformer."""

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"model_type {self.model_type!r} is not supported; expected one of "
                       f"{SUPPORTED_MODEL_TYPES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; expected one "
                       f"of {SUPPORTED_ROPE_TYPES}")

  @property
  def rope_type(self) -> str:
    return dict(self.rope_scaling or ()).get("rope_type", "default")

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
    attention = e * d * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.attention_bias:
      attention += d * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attention += 2 * d
    layer = attention + 3 * e * f + 2 * e
    embeddings = self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * layer + embeddings + e

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
    """Builds a config from the dict of a Hugging Face config.json."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"config.json has model_type {model_type!r}; supported: "
                       f"{SUPPORTED_MODEL_TYPES}")
    if hf.get("use_sliding_window"):
      raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
    if hf.get("mlp_bias"):
      raise ValueError("mlp_bias=true is not supported")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
      raise ValueError(f"layer_types {hf['layer_types']} are not supported; only full_attention")
    num_heads = hf["num_attention_heads"]
    # transformers >= 5 writes rope_parameters; checkpoints on the Hub have rope_theta and
    # rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope_scaling = None if rope == {"rope_type": "default"} else tuple(sorted(rope.items()))
    eos = hf.get("eos_token_id")
    return cls(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=(num_heads
                      if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"]),
        head_dim=(hf["hidden_size"] // num_heads if hf.get("head_dim") is None else hf["head_dim"]),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (its config.json does not say so).
        attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos)

  @classmethod
  def from_json(cls, path: str | pathlib.Path) -> "ModelConfig":
    return cls.from_hf(json.loads(pathlib.Path(path).read_text()))

  def to_hf(self) -> dict[str, Any]:
    """The config.json dict that transformers loads back into the same architecture."""
    architecture = {
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"
    }[self.model_type]
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if self.model_type == "llama":
      hf["attention_bias"] = self.attention_bias
      hf["mlp_bias"] = False
    if self.model_type == "qwen2":
      hf["use_sliding_window"] = False
    return hf
