"""The decoder-only transformer shared by Qwen2/2.5, Qwen3 and the Llama family (SmolLM2).

Parameters live in an nnx.Module; the per-layer weights are stacked on a leading "layers" axis
and the forward pass without a cache runs `jax.lax.scan` over them, so the learner's 28-layer
model compiles one layer.
Every parameter carries logical axis names (`axes` metadata) that `agentgym_jax.sharding` maps
onto the (data, fsdp, tensor) mesh.

Numerics: the residual stream, RMSNorm, RoPE, softmax and logits are f32; matmul inputs are cast
to `dtype` (bf16 on accelerators and on AMX CPUs) and accumulate in f32.

LoRA adapters (`adapters`, agentgym_jax/models/lora.py) add their low-rank path to the
projections they target on the uncached path, the learner's; the sampler runs merged weights.

Attention without a cache (the learner's packed rows) runs the implementation named by
`attention` (agentgym_jax/models/attention.py: by default flash attention, or the Pallas kernel on
TPU). With a cache, one new token per row (a decode step) reads only its row's live slots
(`attention.decode_attention`), and several (a prefill) the dense reference over the cache window.

With a cache the layers run unrolled, each on its own cache arrays and its own weights: the
scan over stacked layers slices a layer's weights and cache window out of their stacks, a copy
of every weight and of the window at every decode step. `cached_layers` takes the per-layer
weights out of their stack once (as `DecodeLayer`s: q, k, v and gate, up fused), so a decode
loop slices them once per call, not per step.

KV cache semantics (used by the sampler for multi-turn continuation): row b of the cache holds
`lengths[b]` valid slots. A forward with a cache writes the new tokens of row b at slots
lengths[b], lengths[b] + 1, ..., and a token at slot s attends to slots <= s. Right padding of
the new tokens is harmless: a padded token's slot is overwritten by the row's next real token
before any real token can attend to it. So there is no separate cache mask, and RoPE position
equals slot unless positions are given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from agentgym_jax import sharding
from agentgym_jax.models import attention as attention_lib
from agentgym_jax.models.attention import bits_dtype, dot, to_bits
from agentgym_jax.models.config import ModelConfig

Array = jax.Array

# The projections of a block, each an einsum of (input, weight) -> output whose weight's leading
# axes are the input's (contracted) axes and its trailing axes the output's. LoRA adapts any of
# them by these names (agentgym_jax/models/lora.py).
PROJECTIONS = {
    "q_proj": "bte,ehd->bthd",
    "k_proj": "bte,ekd->btkd",
    "v_proj": "bte,ekd->btkd",
    "o_proj": "bthd,hde->bte",
    "gate_proj": "bte,ef->btf",
    "up_proj": "bte,ef->btf",
    "down_proj": "btf,fe->bte",
}


def matmul_copy(params: nnx.State, dtype: Any) -> nnx.State:
  """A copy (new buffers: a donated update cannot touch it) of a Decoder's parameters whose
  projections and LM head, which the model reads only as matmul inputs cast to its matmul dtype
  (`attention.dot`), are stored in that `dtype` where it is narrower than theirs: the forward
  pass reads the same values (f32 accumulation of the same bf16 products) from half the bytes
  when f32 parameters meet bf16 matmuls. The embedding (also looked up), norms and biases stay
  as they are."""
  matmul_only = {*PROJECTIONS, "lm_head"}
  narrower = lambda x: jnp.dtype(dtype).itemsize < x.dtype.itemsize

  def copy(path, x):
    cast = narrower(x) and any(getattr(key, "key", None) in matmul_only for key in path)
    return jnp.array(x, dtype=dtype if cast else x.dtype, copy=True)

  return jax.tree_util.tree_map_with_path(copy, params)


def _residual_axes(cached: bool) -> tuple[str, str, str]:
  """The residual stream's logical axes: split along the sequence in the learner, whose full
  remat keeps it for every layer; whole in the sampler, whose decode steps are one token long."""
  return ("batch", "seq" if cached else "residual_seq", "activation_embed")


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@struct.dataclass
class KVCache:
  """Keys and values on a static number of slots, one array per layer, and each row's used
  slots.

  One array per layer rather than one stacked [layers, ...] array: each layer's step then
  updates and reads its own buffer in place (a layer of a stack is a slice, which XLA copies).

  Keys and values of `dtype` are stored as their raw bits (the unsigned integer type of the
  same width) because new tokens are scattered into the cache, and XLA:CPU runs a bf16 scatter
  in f32, converting the whole cache there and back in every layer; an integer scatter of the
  same bits updates the buffer in place.

  Kv heads come before slots so that a decode step reads the keys of each (row, kv head) as one
  contiguous [slots, head_dim] matrix, a batched matmul with no transpose of the cache (on CPU
  3-4x faster than a [slots, kv_heads] layout).
  """

  k: tuple[Array, ...]  # layers x [batch, kv_heads, slots, head_dim] bits of `dtype`
  v: tuple[Array, ...]  # layers x [batch, kv_heads, slots, head_dim] bits of `dtype`
  lengths: Array  # [batch] int32
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)

  AXES = attention_lib.CACHE_AXES  # Of each layer's array.

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, slots: int, dtype: Any) -> "KVCache":
    dtype = jnp.dtype(dtype)
    shape = (batch, config.num_kv_heads, slots, config.head_dim)
    bits = bits_dtype(dtype)
    layers = lambda: tuple(jnp.zeros(shape, bits) for _ in range(config.num_layers))
    return cls(k=layers(), v=layers(), lengths=jnp.zeros((batch,), jnp.int32), dtype=dtype)

  @property
  def slots(self) -> int:
    return self.k[0].shape[2]


def _array(weight: nnx.Variable | Array) -> Array:
  """The array of a weight that is a Variable (of `Layers`) or already an array (`DecodeLayer`)."""
  return weight.value if isinstance(weight, nnx.Variable) else weight


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype: Any,
           scale: float | None = None) -> nnx.Param:
  """A normal(0, scale) parameter (scale defaults to 1/sqrt(fan-in)), or ones when scale=0."""
  if scale == 0:
    value = jnp.ones(shape, dtype)
  else:
    fan_in = shape[1] if len(shape) > 2 else shape[-1]
    std = scale if scale is not None else 1.0 / math.sqrt(fan_in)
    value = std * jax.random.normal(rngs.params(), shape, dtype)
  return nnx.Param(value, axes=axes)


def _zeros(shape: tuple[int, ...], axes: tuple[str, ...], dtype: Any) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, dtype), axes=axes)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
  x = x.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * weight.astype(jnp.float32)


def rope_frequencies(config: ModelConfig) -> Array:
  """Inverse frequencies [head_dim // 2] of rotary embeddings, with the configured scaling."""
  d = config.head_dim
  inv_freq = 1.0 / (config.rope_theta**(jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  scaling = dict(config.rope_scaling or ())
  if config.rope_type == "linear":
    inv_freq = inv_freq / scaling["factor"]
  elif config.rope_type == "llama3":
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    ramp = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    inv_freq = jnp.where(wavelength > original / low, inv_freq / factor,
                         jnp.where(wavelength < original / high, inv_freq, ramp))
  return inv_freq


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
  """Rotates x [B, T, H, D] by positions [B, T] (the rotate-half layout of HF Llama/Qwen)."""
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x = x.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Layers(nnx.Module):
  """All transformer blocks, each weight stacked on a leading layers axis."""

  def __init__(self, config: ModelConfig, param_dtype: Any, rngs: nnx.Rngs):
    n, e, f = config.num_layers, config.hidden_size, config.intermediate_size
    h, k, d = config.num_heads, config.num_kv_heads, config.head_dim
    p = lambda shape, axes, **kw: _param(rngs, (n, *shape), ("layers", *axes), param_dtype, **kw)
    self.input_norm = p((e,), ("norm",), scale=0)
    self.q_proj = p((e, h, d), ("embed", "heads", "head_dim"))
    self.k_proj = p((e, k, d), ("embed", "kv_heads", "head_dim"))
    self.v_proj = p((e, k, d), ("embed", "kv_heads", "head_dim"))
    self.o_proj = p((h, d, e), ("heads", "head_dim", "embed"), scale=1.0 / math.sqrt(h * d))
    if config.attention_bias:
      self.q_bias = _zeros((n, h, d), ("layers", "heads", "head_dim"), param_dtype)
      self.k_bias = _zeros((n, k, d), ("layers", "kv_heads", "head_dim"), param_dtype)
      self.v_bias = _zeros((n, k, d), ("layers", "kv_heads", "head_dim"), param_dtype)
    if config.qk_norm:
      self.q_norm = p((d,), ("norm",), scale=0)
      self.k_norm = p((d,), ("norm",), scale=0)
    self.post_attention_norm = p((e,), ("norm",), scale=0)
    self.gate_proj = p((e, f), ("embed", "mlp"))
    self.up_proj = p((e, f), ("embed", "mlp"))
    self.down_proj = p((f, e), ("mlp", "embed"))


@struct.dataclass
class DecodeLayer:
  """One layer's weights for the cached (sampling) path, out of their stack.

  q, k and v are one [in, out] matrix and gate and up another, so a step runs four weight
  matmuls a layer instead of seven (on SmolLM2's shapes the dense matmuls of a decode step at
  batch 8-64 ran ~8% faster on a 2-core CPU). `Decoder.cached_layers` makes them from the
  stacked parameters once per sampler call, or once per params (`Sampler(keep_layout=...)`).
  """

  input_norm: Array  # [E]
  qkv: Array  # [E, (H + 2K) * D]
  o: Array  # [H * D, E]
  post_attention_norm: Array  # [E]
  gate_up: Array  # [E, 2F]
  down: Array  # [F, E]
  qkv_bias: Array | None = None  # [(H + 2K) * D]
  q_norm: Array | None = None  # [D]
  k_norm: Array | None = None  # [D]


class Cached(NamedTuple):
  """The cached (sampling) path of `Decoder.hidden_states`: the KV cache the new tokens are
  appended to; the slots [0, window) that a forward pass of several tokens reads (static;
  None: all of them); the weights of `Decoder.cached_layers()`, when the caller took them
  out once for many calls (a decode loop; None: they are taken per call); and the cache row
  each input row continues (`rows` [B], distinct; None: row b of a cache of B rows), so that a
  pass on a few rows of a large cache computes on those rows alone."""

  cache: KVCache
  window: int | None = None
  layers: Sequence[DecodeLayer] | None = None
  rows: Array | None = None


class _CacheUpdate(NamedTuple):
  """One layer's part of a cached forward pass (`Decoder._block`)."""

  slots: Array  # [B, T] the slots the new tokens' keys and values are written at
  window: int  # the slots [0, window) that several new tokens attend over
  k_bits: Array  # this layer's cached keys, raw bits of `dtype` (see `KVCache`)
  v_bits: Array  # this layer's cached values, likewise
  dtype: Any  # the cache's dtype
  rows: Array | None  # the cache row of each input row (None: the same)


class Unembedding(NamedTuple):
  """The vocabulary projection: its weight, [V, E] when `vocab_major` (a tied embedding) else
  [E, V], and the matmul dtype of its inputs."""

  weight: Array
  vocab_major: bool
  dtype: Any


class Decoder(nnx.Module):
  """A causal LM: token ids -> next-token logits.

  `dtype` is the matmul input dtype; `param_dtype` the storage dtype of the parameters;
  `remat` one of REMAT_POLICIES (what the backward pass keeps from each layer); `attention` one
  of attention.IMPLEMENTATIONS (the uncached path's attention).
  """

  def __init__(self, config: ModelConfig, *, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, remat: str = "none", attention: str = "auto",
               rngs: nnx.Rngs | None = None):
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat {remat!r} is not one of {sorted(REMAT_POLICIES)}")
    if attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f"attention {attention!r} is not one of {attention_lib.IMPLEMENTATIONS}")
    rngs = rngs or nnx.Rngs(0)
    self.config = config
    self.dtype = dtype
    self.remat = remat
    self.attention = attention
    e = config.hidden_size
    self.embed_tokens = _param(rngs, (config.vocab_size, e), ("vocab", "embed"), param_dtype,
                               scale=0.02)
    self.layers = Layers(config, param_dtype, rngs)
    self.final_norm = _param(rngs, (e,), ("norm",), param_dtype, scale=0)
    if not config.tie_word_embeddings:
      self.lm_head = _param(rngs, (e, config.vocab_size), ("embed", "vocab"), param_dtype,
                            scale=0.02)

  def __call__(self, input_ids: Array, positions: Array | None = None,
               attention_mask: Array | None = None) -> Array:
    """Logits [B, T, V] (f32) of input_ids [B, T].

    attention_mask [B, T] (1 = real token) hides padding keys, so left- and right-padded batches
    both work; positions [B, T] default to 0..T-1.
    """
    hidden, _ = self.hidden_states(input_ids, positions, attention_mask)
    return self.logits(hidden)

  def hidden_states(self, input_ids: Array, positions: Array | None = None,
                    attention_mask: Array | None = None, cached: Cached | None = None, *,
                    segment_ids: Array | None = None, shared_prompt: bool = False,
                    adapters: Any = None,
                    dropout_key: Array | None = None) -> tuple[Array, KVCache | None]:
    """Final-normed hidden states [B, T, E] (f32) and the updated cache (None without one).

    Without a cache a token attends to the earlier tokens of its row that attention_mask keeps
    (padding queries see only padding: their outputs mean nothing), or, given segment_ids
    [B, T] in place of a mask, to the earlier tokens of its segment; with `shared_prompt` also
    to segment 0, the prompt that the row's continuations share (attention.causal_attention;
    the positions then restart for each continuation).
    With a cache (`cached`, a `Cached`: the cache, a window and optionally the decode layers)
    the tokens are appended to each row's live slots (see the module docstring); the cache's
    lengths grow by attention_mask.sum(-1) (by T without a mask). One token per row (T = 1)
    reads only the slots its row holds, and a masked row reads nothing. Several read the slots
    [0, cached.window) (static, default: all), below which every real token must sit.
    cached.layers are the weights of `cached_layers()`, when the caller took them out once for
    many calls (a decode loop); by default they are taken here.

    `adapters` (a lora.Adapters, stacked on the layers axis like the weights) adds each
    adapted projection's low-rank term, its input dropped out with `dropout_key` (None: no
    dropout); the cached path takes no adapters (the sampler runs merged weights).
    """
    config = self.config
    if adapters is not None and cached is not None:
      raise ValueError("adapters apply to the uncached (learner) path; sample with merged weights")
    batch, length = input_ids.shape
    if (segment_ids is not None or shared_prompt) and (cached is not None
                                                       or attention_mask is not None):
      raise ValueError("segment ids replace the attention mask and take no cache")
    if cached is None:
      slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      # Causal by index; real tokens and padding are two segments.
      mask = segment_ids if attention_mask is None else attention_mask.astype(jnp.int32)
    else:
      cache = cached.cache
      window = cache.slots if cached.window is None else cached.window
      if not 0 < window <= cache.slots:
        raise ValueError(f"cached.window={cached.window} is not in [1, {cache.slots}]")
      rows = jnp.arange(batch) if cached.rows is None else cached.rows
      slots = cache.lengths[rows][:, None] + jnp.arange(length, dtype=jnp.int32)
      if length == 1:
        # visible[b]: row b attends to its slots [0, visible[b]), the new token's included.
        live = True if attention_mask is None else attention_mask[:, 0].astype(bool)
        mask = jnp.where(live, slots[:, 0] + 1, 0)
      else:
        # mask[b, q, k]: causal by slot.
        mask = jnp.arange(window, dtype=jnp.int32)[None, None, :] <= slots[:, :, None]
    if positions is None:
      positions = slots

    x = jnp.take(self.embed_tokens.value, input_ids, axis=0).astype(jnp.float32)
    x = sharding.constrain(x, _residual_axes(cached=cached is not None))
    inv_freq = rope_frequencies(config)
    layer_graph, layer_params = nnx.split(self.layers)
    adapter_graph, adapter_params = nnx.split(adapters) if adapters is not None else (None, None)

    def block(x, params, cache_update, adapted=None):
      p = nnx.merge(layer_graph, params)
      lora = None
      if adapted is not None:
        layer_adapters, layer = adapted
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, layer)
        lora = (nnx.merge(adapter_graph, layer_adapters), key)
      return self._block(p, x, positions, mask, inv_freq, cache_update, lora, shared_prompt)

    if cached is None:
      policy = REMAT_POLICIES[self.remat]
      # Rematerialisation only matters for a backward pass; the cached (sampling) path has none.
      if self.remat != "none":
        block = jax.checkpoint(block, policy=policy)

      def body(x, inputs):
        params, adapted = inputs
        x, _ = block(x, params, None, adapted)
        return x, None

      adapted = None if adapters is None else (adapter_params, jnp.arange(config.num_layers))
      x, _ = jax.lax.scan(body, x, (layer_params, adapted))
      new_cache = None
    else:
      layers = self.cached_layers() if cached.layers is None else cached.layers
      k_bits, v_bits = [], []
      for layer, k, v in zip(layers, cache.k, cache.v):
        x, (k, v) = self._block(layer, x, positions, mask, inv_freq,
                                _CacheUpdate(slots, window, k, v, cache.dtype, cached.rows))
        k_bits.append(k)
        v_bits.append(v)
      added = length if attention_mask is None else attention_mask.sum(-1).astype(jnp.int32)
      new_cache = cache.replace(k=tuple(k_bits), v=tuple(v_bits),
                                lengths=cache.lengths.at[rows].add(added))
    x = rms_norm(x, self.final_norm.value, config.rms_norm_eps)
    return x, new_cache

  def cached_layers(self) -> list[DecodeLayer]:
    """Each layer's weights out of their stack, in the decode layout (`DecodeLayer`).

    16-bit weights are sliced and laid out as raw bits: XLA:CPU converts a stacked bf16 array to
    f32 before slicing it (which made a bf16 decode step 5x slower). Bits do not differentiate;
    the cached path is inference only.
    """
    config, stacked = self.config, self.layers
    e = config.hidden_size

    def layer(index: int) -> DecodeLayer:

      def raw(name: str) -> Array:
        value = getattr(stacked, name).value
        return (to_bits(value) if value.dtype.itemsize == 2 else value)[index]

      def joined(*names: str, shape: tuple[int, ...] = (e, -1)) -> Array:
        """The named weights, each reshaped to `shape`, side by side along the last axis, in
        their dtype (one for the names joined: `matmul_copy` casts all projections or none)."""
        bits = jnp.concatenate([raw(name).reshape(shape) for name in names], axis=-1)
        return jax.lax.bitcast_convert_type(bits, getattr(stacked, names[0]).value.dtype)

      vector = (-1,)
      fields = dict(input_norm=joined("input_norm", shape=vector),
                    post_attention_norm=joined("post_attention_norm", shape=vector),
                    qkv=joined("q_proj", "k_proj", "v_proj"), o=joined("o_proj", shape=(-1, e)),
                    gate_up=joined("gate_proj", "up_proj"), down=joined("down_proj", shape=(-1, e)))
      if config.attention_bias:
        fields["qkv_bias"] = joined("q_bias", "k_bias", "v_bias", shape=vector)
      if config.qk_norm:
        fields.update(q_norm=joined("q_norm", shape=vector), k_norm=joined("k_norm", shape=vector))
      return DecodeLayer(**fields)

    return [layer(index) for index in range(config.num_layers)]

  def unembedding(self) -> Unembedding:
    """The vocabulary projection: the tied embedding [V, E] or lm_head [E, V]."""
    if self.config.tie_word_embeddings:
      return Unembedding(self.embed_tokens.value, True, self.dtype)
    return Unembedding(self.lm_head.value, False, self.dtype)

  def logits(self, hidden: Array) -> Array:
    """Logits [..., V] in f32 from final hidden states [..., E]."""
    head = self.unembedding()
    logits = dot("...e,ve->...v" if head.vocab_major else "...e,ev->...v", hidden, head.weight,
                 self.dtype)
    return sharding.constrain(logits, ("batch", "seq", "activation_vocab")) \
        if logits.ndim == 3 else logits

  def _block(self, p: Layers | DecodeLayer, x: Array, positions: Array, mask: Array | None,
             inv_freq: Array, cache_update: _CacheUpdate | None,
             lora: tuple[Any, Array | None] | None = None, shared_prompt: bool = False):
    """One transformer block, on one layer of the stacked `Layers` or a `DecodeLayer`.

    Without a cache `mask` is the segment ids [B, T] (or None; with `shared_prompt` segment 0 is
    the prompt every segment sees). With `cache_update` (a `_CacheUpdate`: the slots [B, T], the
    window, this layer's cache as raw bits, see `KVCache`, the cache's dtype and the cache row of
    each input row), the new keys and values are written at the slots and `mask` is, for T = 1,
    the visible slots [B] of each row, else the mask [B, T, window] of visible cache slots.
    Returns x and the updated (k_bits, v_bits), or None without a cache. `lora` = (this layer's
    adapters, its dropout key or None) adds the adapters' terms to the projections they target
    (`Layers` only: the sampler's `DecodeLayer`s hold merged weights).
    """
    config, dtype = self.config, self.dtype
    eps = config.rms_norm_eps

    def project(name: str, inputs: Array) -> Array:
      out = dot(PROJECTIONS[name], inputs, getattr(p, name).value, dtype)
      if lora is not None and name in lora[0].targets:
        out = out + lora[0].term(name, inputs, dtype, lora[1])
      return out

    h = rms_norm(x, _array(p.input_norm), eps)
    q, k, v = self._qkv(p, h, project)
    if config.qk_norm:
      q = rms_norm(q, _array(p.q_norm), eps)
      k = rms_norm(k, _array(p.k_norm), eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    q = sharding.constrain(q, ("batch", "seq", "activation_heads", "head_dim"))

    caches = None
    if cache_update is not None:
      slots, window, k_bits, v_bits, cache_dtype, cache_rows = cache_update
      rows = jnp.arange(x.shape[0]) if cache_rows is None else cache_rows
      # Out-of-range slots (padding past the cache end) are dropped, never wrapped around.
      # new [B, T, K, D] goes to [rows[b], :, slots[b, t]] of the [N, K, S, D] cache.
      write = lambda bits, new: bits.at[rows[:, None], :, slots].set(
          jax.lax.bitcast_convert_type(new.astype(cache_dtype), bits.dtype), mode="drop")
      k_bits, v_bits = write(k_bits, k), write(v_bits, v)
      caches = (k_bits, v_bits)
      if x.shape[1] == 1:
        attended = attention_lib.decode_attention(q[:, 0], k_bits, v_bits, mask, cache_dtype, dtype,
                                                  rows=cache_rows)[:, None]
      else:
        # The window's slots, of the input rows' cache rows only.
        taken = lambda bits: bits if cache_rows is None else bits[cache_rows]
        read = lambda bits: jax.lax.bitcast_convert_type(taken(bits[:, :, :window]), cache_dtype)
        attended = attention_lib.dense_attention(q, read(k_bits), read(v_bits), mask, dtype)
    else:
      attended = attention_lib.causal_attention(q, k, v, mask, implementation=self.attention,
                                                dtype=dtype, shared_prompt=shared_prompt)
    if isinstance(p, DecodeLayer):
      x = x + dot("btn,ne->bte", attended.reshape(*attended.shape[:2], -1), p.o, dtype)
    else:
      x = x + project("o_proj", attended)
    h = rms_norm(x, _array(p.post_attention_norm), eps)
    if isinstance(p, DecodeLayer):
      gate, up = jnp.split(dot("bte,en->btn", h, p.gate_up, dtype), 2, axis=-1)
    else:
      gate = project("gate_proj", h)
      up = project("up_proj", h)
    hidden = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "seq", "activation_mlp"))
    if isinstance(p, DecodeLayer):
      x = x + dot("btf,fe->bte", hidden, p.down, dtype)
    else:
      x = x + project("down_proj", hidden)
    x = sharding.constrain(x, _residual_axes(cached=cache_update is not None))
    return x, caches

  def _qkv(self, p: Layers | DecodeLayer, h: Array,
           project: Callable[[str, Array], Array]) -> tuple[Array, Array, Array]:
    """q [B, T, H, D], k and v [B, T, K, D] (f32, biases added) of normed inputs h [B, T, E];
    `project(name, h)` projects through a `Layers` weight (with its adapters, if any)."""
    config, dtype = self.config, self.dtype
    if isinstance(p, DecodeLayer):
      qkv = dot("bte,en->btn", h, p.qkv, dtype)
      if p.qkv_bias is not None:
        qkv = qkv + p.qkv_bias.astype(jnp.float32)
      heads, kv_heads = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
      q, k, v = jnp.split(qkv, [heads, heads + kv_heads], axis=-1)
      split = lambda x: x.reshape(*x.shape[:2], -1, config.head_dim)
      return split(q), split(k), split(v)
    q, k, v = project("q_proj", h), project("k_proj", h), project("v_proj", h)
    if config.attention_bias:
      q = q + p.q_bias.value.astype(jnp.float32)
      k = k + p.k_bias.value.astype(jnp.float32)
      v = v + p.v_bias.value.astype(jnp.float32)
    return q, k, v
