"""The decoder-only transformer shared by Qwen2/2.5, Qwen3 and the Llama family (SmolLM2).

Parameters live in an nnx.Module; the per-layer weights are stacked on a leading "layers" axis
and the forward pass runs `jax.lax.scan` over them, so a 28-layer model compiles one layer.
Every parameter carries logical axis names (`axes` metadata) that `agentgym_jax.sharding` maps
onto the (data, fsdp, tensor) mesh.

Numerics: the residual stream, RMSNorm, RoPE, softmax and logits are f32; matmul inputs are cast
to `dtype` (bf16 on accelerators and on AMX CPUs) and accumulate in f32.

Attention without a cache (the learner's packed rows) runs the implementation named by
`attention` (agentgym_jax/models/attention.py: by default flash attention, or the Pallas kernel on
TPU); with a cache it is the dense reference over the cache window.

KV cache semantics (used by the sampler for multi-turn continuation): row b of the cache holds
`lengths[b]` valid slots. A forward with a cache writes the new tokens of row b at slots
lengths[b], lengths[b] + 1, ..., and a token at slot s attends to slots <= s. Right padding of
the new tokens is harmless: a padded token's slot is overwritten by the row's next real token
before any real token can attend to it. So there is no separate cache mask, and RoPE position
equals slot unless positions are given.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from agentgym_jax import sharding
from agentgym_jax.models import attention as attention_lib
from agentgym_jax.models.attention import dot
from agentgym_jax.models.config import ModelConfig

Array = jax.Array

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@struct.dataclass
class KVCache:
  """Per-layer keys and values on a static number of slots, and each row's used slots.

  Keys and values of `dtype` are stored as their raw bits (the unsigned integer type of the
  same width) because new tokens are scattered into the cache, and XLA:CPU runs a bf16 scatter
  in f32, converting the whole cache there and back in every layer; an integer scatter of the
  same bits updates the buffer in place. `keys` and `values` view them as `dtype`.

  Kv heads come before slots so that a decode step reads the keys of each (row, kv head) as one
  contiguous [slots, head_dim] matrix, a batched matmul with no transpose of the cache (on CPU
  3-4x faster than a [slots, kv_heads] layout).
  """

  k: Array  # [layers, batch, kv_heads, slots, head_dim] bits of `dtype`
  v: Array  # [layers, batch, kv_heads, slots, head_dim] bits of `dtype`
  lengths: Array  # [batch] int32
  dtype: Any = struct.field(pytree_node=False, default=jnp.float32)

  AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, slots: int, dtype: Any) -> "KVCache":
    dtype = jnp.dtype(dtype)
    shape = (config.num_layers, batch, config.num_kv_heads, slots, config.head_dim)
    bits = _bits_dtype(dtype)
    return cls(
        k=jnp.zeros(shape, bits), v=jnp.zeros(shape, bits), lengths=jnp.zeros((batch,), jnp.int32),
        dtype=dtype)

  @property
  def slots(self) -> int:
    return self.k.shape[3]

  @property
  def keys(self) -> Array:
    return jax.lax.bitcast_convert_type(self.k, self.dtype)

  @property
  def values(self) -> Array:
    return jax.lax.bitcast_convert_type(self.v, self.dtype)


def _bits_dtype(dtype: Any) -> Any:
  """The unsigned integer type as wide as `dtype`."""
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def _to_bits(x: Array) -> Array:
  return jax.lax.bitcast_convert_type(x, _bits_dtype(x.dtype))


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
                    attention_mask: Array | None = None, cache: KVCache | None = None, *,
                    cache_window: int | None = None, segment_ids: Array | None = None,
                    shared_prompt: bool = False) -> tuple[Array, KVCache | None]:
    """Final-normed hidden states [B, T, E] (f32) and the updated cache.

    Without a cache a token attends to the earlier tokens of its row that attention_mask keeps
    (padding queries see only padding: their outputs mean nothing), or, given segment_ids
    [B, T] in place of a mask, to the earlier tokens of its segment; with `shared_prompt` also
    to segment 0, the prompt that the row's continuations share (attention.causal_attention;
    the positions then restart for each continuation).
    With a cache the tokens are appended to each row's live slots (see the module docstring);
    the cache's lengths grow by attention_mask.sum(-1) (by T without a mask). `cache_window`
    (static) limits attention to slots [0, cache_window): every real token must then sit below
    it. Decoding reads the cache once per step, so a window that covers only the live prefix
    saves the read of the empty tail.
    """
    config = self.config
    batch, length = input_ids.shape
    if (segment_ids is not None or shared_prompt) and (cache is not None
                                                       or attention_mask is not None):
      raise ValueError("segment ids replace the attention mask and take no cache")
    if cache is None:
      slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
      # Causal by index; real tokens and padding are two segments.
      mask = segment_ids if attention_mask is None else attention_mask.astype(jnp.int32)
    else:
      window = cache.slots if cache_window is None else cache_window
      if not 0 < window <= cache.slots:
        raise ValueError(f"cache_window={cache_window} is not in [1, {cache.slots}]")
      slots = cache.lengths[:, None] + jnp.arange(length, dtype=jnp.int32)
      # mask[b, q, k]: causal by slot.
      mask = jnp.arange(window, dtype=jnp.int32)[None, None, :] <= slots[:, :, None]
    if positions is None:
      positions = slots

    x = jnp.take(self.embed_tokens.value, input_ids, axis=0).astype(jnp.float32)
    x = sharding.constrain(x, ("batch", "seq", "activation_embed"))
    inv_freq = rope_frequencies(config)
    layer_graph, layer_params = nnx.split(self.layers)

    def block(x, params, cache_update):
      p = nnx.merge(layer_graph, params)
      return self._block(p, x, positions, mask, inv_freq, slots, cache_update, shared_prompt)

    policy = REMAT_POLICIES[self.remat]
    # Rematerialisation only matters for a backward pass; the cached (sampling) path has none.
    if self.remat != "none" and cache is None:
      block = jax.checkpoint(block, policy=policy)

    if cache is None:

      def body(x, params):
        x, _ = block(x, params, None)
        return x, None

      x, _ = jax.lax.scan(body, x, layer_params)
      new_cache = None
    else:
      # The whole cache rides in the carry and each layer scatters its new keys and values
      # straight into it, so XLA updates it in place: slicing out a layer, updating the slice
      # and writing it back would copy the layer's cache twice per step.
      # 16-bit weights are sliced out of their stack as raw bits too: XLA:CPU converts a
      # stacked bf16 array to f32 before slicing it, which made a bf16 decode step 5x slower.
      # (Bits do not differentiate; the cache path is inference only.) In a decode loop the
      # conversion to bits is loop-invariant, so XLA does it once per call.
      dtypes = jax.tree.map(lambda p: p.dtype, layer_params)
      as_bits = lambda p: _to_bits(p) if p.dtype.itemsize == 2 else p

      def body(carry, inputs):
        x, k_bits, v_bits = carry
        param_bits, index = inputs
        params = jax.tree.map(jax.lax.bitcast_convert_type, param_bits, dtypes)
        x, (k_bits, v_bits) = block(x, params, (index, window, k_bits, v_bits, cache.dtype))
        return (x, k_bits, v_bits), None

      xs = (jax.tree.map(as_bits, layer_params), jnp.arange(config.num_layers))
      (x, k_bits, v_bits), _ = jax.lax.scan(body, (x, cache.k, cache.v), xs)
      added = length if attention_mask is None else attention_mask.sum(-1).astype(jnp.int32)
      new_cache = cache.replace(k=k_bits, v=v_bits, lengths=cache.lengths + added)
    x = rms_norm(x, self.final_norm.value, config.rms_norm_eps)
    return x, new_cache

  def logits(self, hidden: Array) -> Array:
    """Logits [..., V] in f32 from final hidden states [..., E]."""
    if self.config.tie_word_embeddings:
      logits = dot("...e,ve->...v", hidden, self.embed_tokens.value, self.dtype)
    else:
      logits = dot("...e,ev->...v", hidden, self.lm_head.value, self.dtype)
    return sharding.constrain(logits, ("batch", "seq", "activation_vocab")) \
        if logits.ndim == 3 else logits

  def _block(self, p: Layers, x: Array, positions: Array, mask: Array | None, inv_freq: Array,
             slots: Array, cache_update: tuple[Array, int, Array, Array, Any] | None,
             shared_prompt: bool = False):
    """One transformer block.

    `mask` is the segment ids [B, T] (or None; with `shared_prompt` segment 0 is the prompt
    every segment sees) without a cache, the mask [B, T, window] of visible cache slots with
    one. With `cache_update` = (layer, window, k_bits, v_bits, cache_dtype) the new keys and values
    go into layer `layer` of the stacked caches (held as raw bits, see `KVCache`) and
    attention reads their first `window` slots. Returns x and the updated (k_bits, v_bits), or
    None without a cache.
    """
    config, dtype = self.config, self.dtype
    eps = config.rms_norm_eps
    h = rms_norm(x, p.input_norm.value, eps)
    q = dot("bte,ehd->bthd", h, p.q_proj.value, dtype)
    k = dot("bte,ekd->btkd", h, p.k_proj.value, dtype)
    v = dot("bte,ekd->btkd", h, p.v_proj.value, dtype)
    if config.attention_bias:
      q = q + p.q_bias.value.astype(jnp.float32)
      k = k + p.k_bias.value.astype(jnp.float32)
      v = v + p.v_bias.value.astype(jnp.float32)
    if config.qk_norm:
      q = rms_norm(q, p.q_norm.value, eps)
      k = rms_norm(k, p.k_norm.value, eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    q = sharding.constrain(q, ("batch", "seq", "activation_heads", "head_dim"))

    caches = None
    if cache_update is not None:
      layer, window, k_bits, v_bits, cache_dtype = cache_update
      rows = jnp.arange(x.shape[0])[:, None]
      # Out-of-range slots (padding past the cache end) are dropped, never wrapped around.
      # new [B, T, K, D] goes to [layer, b, :, slots[b, t]] of the [L, B, K, S, D] cache.
      write = lambda bits, new: bits.at[layer, rows, :, slots].set(
          jax.lax.bitcast_convert_type(new.astype(cache_dtype), bits.dtype), mode="drop")
      read = lambda bits: jax.lax.bitcast_convert_type(
          jax.lax.dynamic_index_in_dim(bits, layer, 0, keepdims=False)[:, :, :window], cache_dtype)
      k_bits, v_bits = write(k_bits, k), write(v_bits, v)
      caches = (k_bits, v_bits)
      attended = attention_lib.dense_attention(q, read(k_bits), read(v_bits), mask, dtype)
    else:
      attended = attention_lib.causal_attention(q, k, v, mask, implementation=self.attention,
                                                dtype=dtype, shared_prompt=shared_prompt)
    out = dot("bthd,hde->bte", attended, p.o_proj.value, dtype)
    x = x + out
    h = rms_norm(x, p.post_attention_norm.value, eps)
    gate = dot("bte,ef->btf", h, p.gate_proj.value, dtype)
    up = dot("bte,ef->btf", h, p.up_proj.value, dtype)
    hidden = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "seq", "activation_mlp"))
    x = x + dot("btf,fe->bte", hidden, p.down_proj.value, dtype)
    x = sharding.constrain(x, ("batch", "seq", "activation_embed"))
    return x, caches
