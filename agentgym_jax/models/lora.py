"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): low-rank
adapters on the decoder's projections, trained while the base weights stay frozen.

A projection y = x W (W [in, out], `decoder.PROJECTIONS`) gets an adapter A [in, r], B [r, out]:

  y = x W + (alpha / r) dropout(x) A B,       delta W = (alpha / r) A B

A is normal with variance 1 / in (in: the product of W's input axes) and B zeros, so at step 0
the adapted model is the base exactly. Shapes and logical axes follow the base weight: A takes
W's input axes (q_proj's A is [embed, r], o_proj's [heads, head_dim, r]), B its output axes;
the rank axis is replicated. Like the weights, every adapter is stacked on a leading layers
axis. Adapters are f32 whatever
model.param_dtype (they are small, and AdamW's small steps would round away in bf16).

Where each piece runs:
  learner   the adapter path above (`LoraModel`, the decoder's uncached forward with
            `adapters`); only the adapters are differentiated, and only they (and AdamW's
            moments of them) are trained, sharded and checkpointed.
  sampler   merged weights W + delta W (`merged_params`), computed once per step when the
            policy is handed to the sampler: no adapter matmuls per decoded token. The merge
            is in f32, stored in W's dtype: with bf16 parameters its rounding separates the
            sampler's log-probs from the learner's (logged as logprob_gap_*, corrected by
            algorithm.rollout_correction); with f32 ones they agree to float noise.
  reference the base: the adapters as initialised (B = 0) add exactly nothing, so the KL's
            reference costs a copy of the adapters instead of a copy of the model.
  export    merged (a Hugging Face directory of W + delta W) or peft (`save_peft`: a PEFT
            adapter directory, adapter_config.json + adapter_model.safetensors under PEFT's
            key names, which peft's PeftModel.from_pretrained loads over the base).

Dropout (PEFT's lora_dropout) drops the adapter's input in the update's forward only: the
experience pass (old and reference log-probs) and the sampler run without it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import sharding
from agentgym_jax.models import weights
from agentgym_jax.models.attention import dot
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import PROJECTIONS, Decoder, Unembedding

Array = jax.Array
TARGETS = tuple(PROJECTIONS)
RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """model.lora: the rank r, alpha (delta W = alpha / r A B), the adapted projections (names
  of decoder.PROJECTIONS) and the dropout of the adapters' input in the update."""

  rank: int
  alpha: float
  targets: tuple[str, ...] = TARGETS
  dropout: float = 0.0


def _split(spec: str) -> tuple[str, str, str, str]:
  """(input letters kept in the output, weight's input letters, weight's output letters, output)
  of a projection's einsum `input,weight->output`."""
  inputs, rest = spec.split(",")
  weight, output = rest.split("->")
  contracted = "".join(letter for letter in weight if letter in inputs)
  return inputs.replace(contracted, ""), contracted, weight[len(contracted):], output


def input_dims(target: str) -> int:
  """How many leading axes of the target's weight (after layers) are its input."""
  return len(_split(PROJECTIONS[target])[1])


def adapter_specs(target: str) -> tuple[str, str, str]:
  """The einsums of the target's adapter: x A, (x A) B and A B (its delta W), with r the rank:
  q_proj's are bte,er->btr; btr,rhd->bthd; er,rhd->ehd."""
  batch, inputs, outputs, output = _split(PROJECTIONS[target])
  x = PROJECTIONS[target].split(",")[0]
  return (f"{x},{inputs}r->{batch}r", f"{batch}r,r{outputs}->{output}",
          f"{inputs}r,r{outputs}->{inputs}{outputs}")


class LoraParam(nnx.Param):
  """An adapter weight: what a LoRA run trains."""


class Adapter(nnx.Module):
  """One projection's A [layers, in..., r] and B [layers, r, out...]."""

  def __init__(self, a: Array, b: Array, a_axes: tuple[str, ...], b_axes: tuple[str, ...]):
    self.a = LoraParam(a, axes=a_axes)
    self.b = LoraParam(b, axes=b_axes)


class Adapters(nnx.Module):
  """The adapters of `settings.targets` for a decoder of `config`, one attribute per target."""

  def __init__(self, config: ModelConfig, settings: LoraSettings, rngs: nnx.Rngs):
    self.targets = tuple(settings.targets)
    self.rank = settings.rank
    self.alpha = settings.alpha
    self.dropout = settings.dropout
    layers = weights.abstract_model(config).layers
    for target in self.targets:
      base = getattr(layers, target)
      shape, axes = base.get_value().shape, tuple(base.axes)
      n = 1 + input_dims(target)
      fan_in = math.prod(shape[1:n])
      a = jax.random.normal(rngs.params(), (*shape[:n], settings.rank), jnp.float32)
      b = jnp.zeros((shape[0], settings.rank, *shape[n:]), jnp.float32)
      setattr(
          self, target,
          Adapter(a / math.sqrt(fan_in), b, (*axes[:n], RANK_AXIS),
                  (axes[0], RANK_AXIS, *axes[n:])))

  @property
  def scale(self) -> float:
    """alpha / r: delta W = scale A B."""
    return self.alpha / self.rank

  def term(self, target: str, x: Array, dtype: Any, dropout_key: Array | None) -> Array:
    """(alpha / r) dropout(x) A B for one layer's adapter of `target` on its input x."""
    adapter = getattr(self, target)
    if self.dropout and dropout_key is not None:
      key = jax.random.fold_in(dropout_key, TARGETS.index(target))
      keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
      x = jnp.where(keep, x / (1.0 - self.dropout), 0.0)
    into, out_of, _ = adapter_specs(target)
    low_rank = self.scale * dot(into, x, adapter.a.value, dtype)
    return dot(out_of, low_rank, adapter.b.value, dtype)

  def delta(self, target: str) -> Array:
    """delta W = (alpha / r) A B of every layer, f32 [layers, in..., out...], at full f32
    precision (a TPU's default f32 matmul rounds its inputs to bf16)."""
    adapter = getattr(self, target)
    _, _, product = adapter_specs(target)
    outer = lambda a, b: jnp.einsum(product, a, b, precision=jax.lax.Precision.HIGHEST)
    return self.scale * jax.vmap(outer)(adapter.a.value, adapter.b.value)


class LoraModel(nnx.Module):
  """The learner's policy under LoRA: the frozen decoder and its adapters, with the decoder's
  `hidden_states` and `logits`. Split with `split`: the adapters are its LoraParams."""

  def __init__(self, decoder: Decoder, adapters: Adapters):
    self.decoder = decoder
    self.adapters = adapters

  @property
  def config(self) -> ModelConfig:
    return self.decoder.config

  def hidden_states(self, input_ids: Array, positions: Array | None = None,
                    attention_mask: Array | None = None, *, segment_ids: Array | None = None,
                    shared_prompt: bool = False,
                    dropout_key: Array | None = None) -> tuple[Array, None]:
    return self.decoder.hidden_states(input_ids, positions, attention_mask, segment_ids=segment_ids,
                                      shared_prompt=shared_prompt, adapters=self.adapters,
                                      dropout_key=dropout_key)

  def unembedding(self) -> Unembedding:
    return self.decoder.unembedding()

  def logits(self, hidden: Array) -> Array:
    return self.decoder.logits(hidden)

  def __call__(self, input_ids: Array, positions: Array | None = None,
               attention_mask: Array | None = None) -> Array:
    hidden, _ = self.hidden_states(input_ids, positions, attention_mask)
    return self.logits(hidden)


def split(model: LoraModel) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, adapters, base): `nnx.merge(graphdef, adapters, base)` rebuilds the model."""
  return nnx.split(model, LoraParam, ...)


def init_adapters(config: ModelConfig, settings: LoraSettings, seed: int,
                  mesh: Mesh | None = None) -> Adapters:
  """Fresh adapters (normal A, zero B) from `seed`, placed by the logical axis rules on
  `mesh`, each device computing only its shards."""
  make = lambda: Adapters(config, settings, nnx.Rngs(seed))
  graphdef, abstract = nnx.split(nnx.eval_shape(make))
  if mesh is None:
    return make()
  state = jax.jit(lambda: nnx.split(make())[1],
                  out_shardings=sharding.state_shardings(abstract, mesh))()
  return nnx.merge(graphdef, state)


def merged_params(graphdef: nnx.GraphDef, adapters: nnx.State, base: nnx.State) -> nnx.State:
  """The decoder's parameters with every adapted weight replaced by W + delta W in W's dtype,
  structured as the decoder's own state: what the sampler and a merged export run. Pure (no
  variable of `base` is changed); jit it with the decoder's shardings."""
  model = nnx.merge(graphdef, adapters, base)
  deltas = {("layers", target): model.adapters.delta(target) for target in model.adapters.targets}

  def merge(path: tuple[Any, ...], variable: nnx.Variable) -> nnx.Variable:
    delta = deltas.get(tuple(str(k) for k in path))
    if delta is None:
      return variable
    value = variable.get_value()
    return variable.replace((value.astype(jnp.float32) + delta).astype(value.dtype))

  decoder = nnx.split(model.decoder)[1]
  return nnx.from_flat_state([(path, merge(path, v)) for path, v in nnx.to_flat_state(decoder)])


# --- PEFT's adapter directory ----------------------------------------------------------------

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_tensors(adapters: Adapters, dtype: Any = jnp.float32) -> dict[str, np.ndarray]:
  """The adapters under PEFT's names and layouts: for layer i and target q_proj,
  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in] (= A^T, the input
  axes flattened as Hugging Face flattens them) and ...lora_B.weight [out, r] (= B^T)."""
  tensors = {}
  for target in adapters.targets:
    template, _ = weights.PARAM_MAP[("layers", target)]
    adapter = getattr(adapters, target)
    a = np.asarray(jax.device_get(adapter.a.get_value())).astype(np.dtype(jnp.dtype(dtype)))
    b = np.asarray(jax.device_get(adapter.b.get_value())).astype(np.dtype(jnp.dtype(dtype)))
    for i in range(a.shape[0]):
      name = PEFT_PREFIX + template.format(i=i).removesuffix(".weight")
      tensors[f"{name}.lora_A.weight"] = a[i].reshape(-1, a.shape[-1]).T
      tensors[f"{name}.lora_B.weight"] = b[i].reshape(b.shape[1], -1).T
  return tensors


def save_peft(adapters: Adapters, directory: str | pathlib.Path, base_model: str,
              dtype: Any = jnp.float32) -> None:
  """Writes a PEFT LoRA adapter directory for a Llama/Qwen2/Qwen3 base named `base_model`."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  peft_config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model,
      "r": adapters.rank,
      "lora_alpha": adapters.alpha,
      "lora_dropout": adapters.dropout,
      "target_modules": sorted(adapters.targets),
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "inference_mode": True,
  }
  (directory / PEFT_CONFIG).write_text(json.dumps(peft_config, indent=2))
  weights.write_safetensors(directory / PEFT_WEIGHTS, peft_tensors(adapters, dtype))


def is_peft(directory: str | pathlib.Path) -> bool:
  return (pathlib.Path(directory).expanduser() / PEFT_CONFIG).is_file()


def peft_base(directory: str | pathlib.Path) -> str:
  """The base model a PEFT adapter directory names (base_model_name_or_path)."""
  return json.loads(
      (pathlib.Path(directory).expanduser() / PEFT_CONFIG).read_text())["base_model_name_or_path"]


def load_peft(directory: str | pathlib.Path, base: Decoder) -> Decoder:
  """`base` with the LoRA adapters of a PEFT adapter directory merged in (`save_peft`'s
  layout, read back), on the base's shardings: a PEFT export plays as the merged model."""
  directory = pathlib.Path(directory).expanduser()
  peft_config = json.loads((directory / PEFT_CONFIG).read_text())
  targets = peft_config["target_modules"]
  targets = (targets,) if isinstance(targets, str) else tuple(targets)
  unsupported = [t for t in targets if t not in TARGETS]
  if (peft_config.get("peft_type") != "LORA" or unsupported or peft_config.get("use_rslora")
      or peft_config.get("bias", "none") != "none"):
    raise ValueError(f"{directory} is not a LoRA adapter this project reads: it needs "
                     f"peft_type LORA, target_modules among {TARGETS} (got {targets}), no bias "
                     "and no rsLoRA")
  settings = LoraSettings(rank=int(peft_config["r"]), alpha=float(peft_config["lora_alpha"]),
                          targets=targets)
  adapters = Adapters(base.config, settings, nnx.Rngs(0))
  reader = weights.SafetensorsReader(directory)
  for target in targets:
    template, _ = weights.PARAM_MAP[("layers", target)]
    adapter = getattr(adapters, target)
    names = [
        PEFT_PREFIX + template.format(i=i).removesuffix(".weight")
        for i in range(base.config.num_layers)
    ]
    a_shape, b_shape = adapter.a.get_value().shape[1:], adapter.b.get_value().shape[1:]
    adapter.a.set_value(
        jnp.stack([np.asarray(reader[f"{n}.lora_A.weight"]).T.reshape(a_shape) for n in names]))
    adapter.b.set_value(
        jnp.stack([np.asarray(reader[f"{n}.lora_B.weight"]).T.reshape(b_shape) for n in names]))
  base_graphdef, base_params = nnx.split(base)
  graphdef, adapter_params, frozen = split(LoraModel(base, adapters))
  merge = jax.jit(functools.partial(merged_params, graphdef),
                  out_shardings=jax.tree.map(lambda x: x.sharding, base_params))
  return nnx.merge(base_graphdef, merge(adapter_params, frozen))
