"""Hugging Face weights in and out: the name mapping, safetensors I/O, sharded placement.

Loading never builds a whole host copy of the model: safetensors files are memory-mapped, the
HF -> ours layout transforms are numpy views, and each parameter is assembled with
`jax.make_array_from_callback`, so every device shard copies only its own slice, one layer at a
time, straight into its target sharding.
"""

from __future__ import annotations

import json
import pathlib
import struct as pystruct
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import sharding
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder

# A mapping from names to arrays: a dict (e.g. from GGUF) or a lazy safetensors reader.
TensorSource = Mapping[str, np.ndarray]

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_SAFETENSORS_NAMES = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}

# Our parameter path -> (HF name template, HF -> ours, ours -> HF). Layer weights take `{i}`.
# Linear weights: HF stores [out, in]; we store [in, (heads, head_dim) | out].
_Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]
_L = "model.layers.{i}."


class WeightsNotFoundError(FileNotFoundError):
  """A model spec whose checkpoint is not on disk; the message says where it goes and how to
  fetch it."""


def _in_heads(n: Callable[[ModelConfig], int]) -> tuple[_Transform, _Transform]:
  to_ours = lambda w, c: w.T.reshape(w.shape[1], n(c), c.head_dim)
  to_hf = lambda w, c: w.reshape(w.shape[0], -1).T
  return to_ours, to_hf


def _heads(n: Callable[[ModelConfig], int]) -> tuple[_Transform, _Transform]:
  return (lambda b, c: b.reshape(n(c), c.head_dim)), (lambda b, c: b.reshape(-1))


_identity = (lambda w, c: w), (lambda w, c: w)
_transpose = (lambda w, c: w.T), (lambda w, c: w.T)
_num_heads = lambda c: c.num_heads
_num_kv_heads = lambda c: c.num_kv_heads

PARAM_MAP: dict[tuple[str, ...], tuple[str, tuple[_Transform, _Transform]]] = {
    ("embed_tokens",): ("model.embed_tokens.weight", _identity),
    ("final_norm",): ("model.norm.weight", _identity),
    ("lm_head",): ("lm_head.weight", _transpose),
    ("layers", "input_norm"): (_L + "input_layernorm.weight", _identity),
    ("layers", "q_proj"): (_L + "self_attn.q_proj.weight", _in_heads(_num_heads)),
    ("layers", "k_proj"): (_L + "self_attn.k_proj.weight", _in_heads(_num_kv_heads)),
    ("layers", "v_proj"): (_L + "self_attn.v_proj.weight", _in_heads(_num_kv_heads)),
    ("layers", "q_bias"): (_L + "self_attn.q_proj.bias", _heads(_num_heads)),
    ("layers", "k_bias"): (_L + "self_attn.k_proj.bias", _heads(_num_kv_heads)),
    ("layers", "v_bias"): (_L + "self_attn.v_proj.bias", _heads(_num_kv_heads)),
    ("layers", "o_proj"): (_L + "self_attn.o_proj.weight",
                           ((lambda w, c: w.T.reshape(c.num_heads, c.head_dim, w.shape[0])),
                            (lambda w, c: w.reshape(-1, w.shape[-1]).T))),
    ("layers", "q_norm"): (_L + "self_attn.q_norm.weight", _identity),
    ("layers", "k_norm"): (_L + "self_attn.k_norm.weight", _identity),
    ("layers", "post_attention_norm"): (_L + "post_attention_layernorm.weight", _identity),
    ("layers", "gate_proj"): (_L + "mlp.gate_proj.weight", _transpose),
    ("layers", "up_proj"): (_L + "mlp.up_proj.weight", _transpose),
    ("layers", "down_proj"): (_L + "mlp.down_proj.weight", _transpose),
}


class SafetensorsReader(Mapping[str, np.ndarray]):
  """Memory-mapped tensors of a Hugging Face checkpoint directory (single or sharded)."""

  def __init__(self, directory: str | pathlib.Path):
    directory = pathlib.Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
      files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
      raise FileNotFoundError(f"no *.safetensors files in {directory}")
    self._entries: dict[str, tuple[pathlib.Path, int, dict[str, Any]]] = {}
    for name in files:
      path = directory / name
      with open(path, "rb") as f:
        (header_size,) = pystruct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
      for tensor, info in header.items():
        if tensor != "__metadata__":
          self._entries[tensor] = (path, 8 + header_size, info)

  def __getitem__(self, name: str) -> np.ndarray:
    path, data_start, info = self._entries[name]
    begin, end = info["data_offsets"]
    dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
    if end == begin:
      return np.zeros(info["shape"], dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin,
                     shape=tuple(info["shape"]))

  def __iter__(self):
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)


def write_safetensors(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes one safetensors file (little-endian, tensors in name order)."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  arrays = {}
  for name in sorted(tensors):
    array = np.ascontiguousarray(tensors[name])
    header[name] = {
        "dtype": _SAFETENSORS_NAMES[array.dtype], "shape": list(array.shape),
        "data_offsets": [offset, offset + array.nbytes]
    }
    arrays[name] = array
    offset += array.nbytes
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)
  with open(path, "wb") as f:
    f.write(pystruct.pack("<Q", len(encoded)))
    f.write(encoded)
    for name in sorted(arrays):
      f.write(arrays[name].tobytes())


def _hf_names(path: tuple[str, ...], config: ModelConfig) -> list[str]:
  template, _ = PARAM_MAP[path]
  if path[0] != "layers":
    return [template]
  return [template.format(i=i) for i in range(config.num_layers)]


def load_params(model: Decoder, source: TensorSource, mesh: Mesh | None = None) -> Decoder:
  """Fills `model` (possibly abstract, from nnx.eval_shape) with weights from `source`.

  With a mesh every parameter is placed with its logical sharding. Each distinct device shard
  is copied out of the source once (replicas share the copy), one layer's slice at a time, into
  a buffer of exactly the shard's size: the layout transforms are views, so with the
  memory-mapped SafetensorsReader host memory never holds more than the shard being placed.
  """
  config = model.config
  graphdef, state = nnx.split(model)
  missing = [
      name for path in _param_paths(state) for name in _hf_names(path, config) if name not in source
  ]
  if missing:
    raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

  def load(path: tuple[str, ...], variable: nnx.Variable) -> nnx.Variable:
    _, (to_ours, _) = PARAM_MAP[path]
    shape, dtype = variable.get_value().shape, np.dtype(variable.get_value().dtype)
    stacked = path[0] == "layers"
    names = _hf_names(path, config)
    layer_shape = shape[1:] if stacked else shape

    def tensor(name: str) -> np.ndarray:
      """The source tensor in our layout, as a view (nothing is read yet)."""
      hf_tensor = np.asarray(source[name])
      try:
        ours = to_ours(hf_tensor, config)
      except ValueError:  # A reshape into heads that does not fit.
        ours = None
      if ours is None or ours.shape != layer_shape:
        raise ValueError(f"checkpoint tensor {name} has shape {hf_tensor.shape}, which does not "
                         f"fit parameter {'.'.join(path)} of shape {layer_shape} under the "
                         f"config {config}")
      return ours

    for name in names:
      tensor(name)
    copies: dict[tuple[tuple[int, int, int], ...], np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
      key = tuple(s.indices(n) for s, n in zip(index, shape))
      if key not in copies:
        shard = np.empty([len(range(*k)) for k in key], dtype)
        if stacked:
          for j, i in enumerate(range(*key[0])):
            shard[j] = tensor(names[i])[index[1:]]
        else:
          shard[...] = tensor(names[0])[index]
        copies[key] = shard
      return copies[key]

    if mesh is None:
      target = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
      target = sharding.named_sharding(mesh, variable.axes, shape)
    return variable.replace(jax.make_array_from_callback(shape, target, read))

  state = _map_params(load, state)
  return nnx.merge(graphdef, state)


def _param_paths(state: nnx.State) -> list[tuple[str, ...]]:
  return [tuple(str(k) for k in path) for path, _ in nnx.to_flat_state(state)]


def _map_params(fn: Callable[[tuple[str, ...], nnx.Variable], Any], state: nnx.State):
  flat = [(path, fn(tuple(str(k) for k in path), variable))
          for path, variable in nnx.to_flat_state(state)]
  return nnx.from_flat_state(flat)


def to_hf_state_dict(model: Decoder, dtype: Any = None) -> dict[str, np.ndarray]:
  """The model's parameters under Hugging Face names and layouts, as host numpy arrays."""
  config = model.config
  tensors: dict[str, np.ndarray] = {}
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    path = tuple(str(k) for k in path)
    _, (_, to_hf) = PARAM_MAP[path]
    value = np.asarray(jax.device_get(variable.get_value()))
    if dtype is not None:
      value = value.astype(dtype)
    names = _hf_names(path, config)
    for i, name in enumerate(names):
      tensors[name] = to_hf(value[i] if path[0] == "layers" else value, config)
  return tensors


def save_hf(model: Decoder, directory: str | pathlib.Path, dtype: Any = jnp.float32,
            max_shard_bytes: int = 4 * 2**30) -> None:
  """Writes config.json and safetensors that transformers loads as is.

  Above `max_shard_bytes` the tensors are split over numbered files with a
  model.safetensors.index.json, as Hugging Face writes large checkpoints.
  """
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  hf_config = model.config.to_hf()
  hf_config["torch_dtype"] = jnp.dtype(dtype).name
  (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
  tensors = to_hf_state_dict(model, np.dtype(jnp.dtype(dtype)))
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors):
    if size and size + tensors[name].nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += tensors[name].nbytes
  if len(shards) == 1:
    write_safetensors(directory / "model.safetensors", shards[0])
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(directory / filename, shard)
    weight_map.update(dict.fromkeys(shard, filename))
  index = {
      "metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map
  }
  (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def abstract_model(config: ModelConfig, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                   remat: str = "none", attention: str = "auto") -> Decoder:
  """A Decoder whose parameters are shape/dtype placeholders (no memory, no compute)."""
  return nnx.eval_shape(lambda: Decoder(config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                        attention=attention, rngs=nnx.Rngs(0)))
