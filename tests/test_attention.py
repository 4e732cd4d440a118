"""Flash and splash attention against the dense reference: values, gradients, memory, the model.

Inputs are f32 with values in [-1, 1] (so |v| <= 1 bounds each output), over rows whose length
is not a multiple of the block, ragged segment masks (right- and left-padded rows, a row packed
with three segments), GQA, MQA and plain multi-head attention, and several block sizes.

Error model of a comparison (tests/tolerances.py): an output o_t = sum_s p_ts v_s is a convex
combination of at most S values (sum_s p_ts = 1), and flash sums it block by block with
rescaled partial sums where the reference sums it at once. The two orders differ by rounding
alone, a random walk of sqrt(S) roundings of the terms, so |o_flash - o_dense| <=
reordered_sum(S) * max|v|. A gradient sums over the same S keys (dq) or queries (dk, dv) with
cancelling terms, so its tolerance is reordered_sum(S) times the largest reference gradient.
With S = 150 that is 5.8e-6 (< 1e-5) of the scale. A wrong mask (one key too many) moves
outputs by ~1/S of their scale, 7e-3 here, a thousand times more.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import core as jax_core

from agentgym_jax import sharding
from agentgym_jax.models import attention
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder

import tolerances

LENGTH = 150  # Not a multiple of any block below.


def _inputs(batch: int, length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 4)
  uniform = lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0)
  q = 2.0 * uniform(keys[0], (batch, length, heads, head_dim))  # Scores up to ~4: peaked rows.
  k = 2.0 * uniform(keys[1], (batch, length, kv_heads, head_dim))
  v = uniform(keys[2], (batch, length, kv_heads, head_dim))
  cotangent = uniform(keys[3], (batch, length, heads, head_dim))
  return q, k, v, cotangent


def _segments(kind: str, batch: int, length: int) -> np.ndarray | None:
  """Segment ids [batch, length]: none, right padding (ragged lengths), left padding, or rows
  packed with several segments."""
  if kind == "none":
    return None
  index = np.arange(length)[None]
  lengths = np.array([length, 97, 1, 130])[:batch, None]
  if kind == "right_padded":
    return (index < lengths).astype(np.int32)
  if kind == "left_padded":
    return (index >= length - lengths).astype(np.int32)
  # "packed": segments [0, 40), [40, 41), [41, 120), [120, T), numbered from 1 (all real).
  return np.broadcast_to(np.searchsorted([40, 41, 120], index, side="right") + 1,
                         (batch, length)).astype(np.int32)


def _real(segments: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
  """Queries whose outputs mean something: all, or the non-padding ones of a padded row."""
  return np.ones(shape, bool) if segments is None else segments != 0


def _value_and_grads(implementation: str, q, k, v, cotangent, segments, **options):
  """The attention's output and the gradients of <output, cotangent> by q, k and v."""

  def loss(q, k, v):
    out = attention.causal_attention(q, k, v, segments, implementation=implementation, **options)
    return jnp.sum(out * cotangent), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def _assert_matches_dense(implementation, heads, kv_heads, segment_kind, batch=4, **options):
  q, k, v, cotangent = _inputs(batch, LENGTH, heads, kv_heads, 16)
  segments = _segments(segment_kind, batch, LENGTH)
  real = _real(segments, (batch, LENGTH))
  # Padding queries' outputs mean nothing; nothing may flow back from them.
  cotangent = cotangent * real[:, :, None, None]
  out, grads = _value_and_grads(implementation, q, k, v, cotangent, segments, **options)
  ref_out, ref_grads = _value_and_grads("dense", q, k, v, cotangent, segments)
  relative = tolerances.reordered_sum(LENGTH)
  assert relative < 1e-5
  tolerances.assert_attention_close(out, ref_out, grads, ref_grads, real=real, v=v,
                                    relative=relative)


@pytest.mark.parametrize("segment_kind, block", [("none", 64), ("right_padded", 32),
                                                 ("left_padded", 128), ("packed", 32)])
def test_flash_matches_dense_values_and_gradients(segment_kind, block):
  _assert_matches_dense("flash", 6, 2, segment_kind, block=block)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1)])  # (6, 2) above.
def test_flash_matches_dense_for_every_head_grouping(heads, kv_heads):
  _assert_matches_dense("flash", heads, kv_heads, "right_padded", batch=2, block=64)


def test_flash_in_bf16_stays_within_bf16_rounding_of_dense():
  q, k, v, _ = _inputs(2, LENGTH, 6, 2, 16)
  run = jax.jit(
      lambda name: attention.causal_attention(q, k, v, None, implementation=name, dtype=jnp.
                                              bfloat16, block=64), static_argnums=0)
  # Both round q, k and v alike; each rounds every probability once to bf16 (relative error
  # 2^-9), flash before normalising and dense after, so an output moves by at most
  # 2 * 2^-9 * sum_s p_s |v_s| <= 2^-8 max|v| = 2^-8; 2^-7 leaves a factor 2 for the f32
  # rescalings. A wrong mask moves outputs by ~1/S = 7e-3, about 2^-7 too, so the f32 tests
  # above are the ones that pin the mask down.
  np.testing.assert_allclose(run("flash"), run("dense"), rtol=0, atol=2.0**-7)


def test_splash_kernel_interpreted_matches_dense():
  # Pallas interpret mode runs the TPU kernel's program on the CPU; T pads to the 128 lanes.
  _assert_matches_dense("splash", 6, 2, "packed", batch=2)


def test_splash_kernel_runs_per_shard_under_a_mesh():
  # Rows split over fsdp and heads (6 and 2 kv heads) over tensor, by shard_map.
  mesh = sharding.make_mesh(1, 2, 2, devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    _assert_matches_dense("splash", 6, 2, "right_padded", batch=2)


def test_auto_picks_the_kernel_by_backend():
  assert attention.choose("auto", "tpu") == "splash"
  assert attention.choose("auto", "cpu") == "flash"
  assert attention.choose("auto", "gpu") == "flash"
  assert attention.choose("dense", "tpu") == "dense"
  with pytest.raises(ValueError, match="not one of"):
    attention.choose("flashy")


def test_flash_block_grows_only_to_bound_the_number_of_blocks():
  assert attention.flash_block(100) == attention.flash_block(8192) == attention.FLASH_BLOCK
  # 32768 tokens in at most 32 blocks: 1024-token tiles.
  assert attention.flash_block(32768) == 1024
  assert -(-32769 // attention.flash_block(32769)) <= attention.MAX_BLOCKS


# --- memory: no [.., T, T] array in the forward or backward pass

_HLO_SHAPE = re.compile(r"\b(?:f64|f32|bf16|f16|s64|s32|s8|u64|u32|u8|pred)\[([0-9,]*)\]")


def _squares_in_hlo(text: str, length: int) -> list[tuple[int, ...]]:
  """Shapes in HLO text with two axes of at least `length`."""
  shapes = {tuple(int(n) for n in dims.split(",") if n) for dims in _HLO_SHAPE.findall(text)}
  return sorted(s for s in shapes if sum(n >= length for n in s) >= 2)


def _squares_in_jaxpr(jaxpr, length: int) -> list[tuple[int, ...]]:
  """The same for every value of a jaxpr, its sub-jaxprs (jit, scan, custom_vjp) included."""
  found = []
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      if sum(n >= length for n in shape) >= 2:
        found.append(shape)
    for sub in jax_core.jaxprs_in_params(eqn.params):
      found.extend(_squares_in_jaxpr(sub, length))
  return found


@pytest.mark.parametrize("implementation", ["flash", "dense"])
def test_flash_keeps_no_length_squared_array_forward_or_backward(implementation):
  length = 1000
  q, k, v, cotangent = _inputs(2, length, 4, 2, 16)
  loss = lambda q, k, v: jnp.sum(cotangent * attention.causal_attention(
      q, k, v, None, implementation=implementation, block=128))
  step = jax.value_and_grad(loss, argnums=(0, 1, 2))
  in_jaxpr = _squares_in_jaxpr(jax.make_jaxpr(step)(q, k, v).jaxpr, length)
  in_hlo = _squares_in_hlo(jax.jit(step).lower(q, k, v).compile().as_text(), length)
  if implementation == "flash":
    assert in_jaxpr == [] and in_hlo == []
  else:  # The check sees the reference's [B, K, G, T, T] scores.
    assert (2, 2, 2, length, length) in in_jaxpr and (2, 2, 2, length, length) in in_hlo


@pytest.mark.slow
def test_flash_gradient_scratch_grows_linearly_with_the_row():
  """What the compiled program keeps live at once, not only which shapes it names: one block
  diagonal's tiles at a time, never all of them (XLA:CPU drops optimization barriers, so the
  diagonals are ordered by data).

  Error model, bytes of the gradient's scratch at T tokens, H heads, tile b: O(T * H * D) for
  the blocked q, k, v, their cotangents and the output, plus a few [T / b, H, b, b] f32 tile
  batches of one diagonal, 4 * T * H * b bytes each: linear in T at a fixed tile. Computing
  every diagonal's tiles before reducing them adds the whole triangle, T^2 / 2 * H * 4 bytes:
  at T = 4096 that is 128 MiB, twice the linear terms' total, and it grows 16x from T = 1024.
  """

  def scratch(length: int) -> int:
    q = jax.ShapeDtypeStruct((1, length, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
    loss = lambda q, k, v: jnp.sum(attention.flash_attention(q, k, v, block=128))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return step.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

  short, long = scratch(1024), scratch(4096)
  triangle = 4096**2 // 2 * 4 * 4
  assert long < triangle, (long, triangle)
  assert long < 8 * short, (short, long)  # linear: 4x, the triangle: 16x


# --- the whole model

CONFIG = ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
                     attention_bias=True)


def _model(implementation: str, remat: str = "none") -> Decoder:
  return Decoder(CONFIG, remat=remat, attention=implementation, rngs=nnx.Rngs(0))


@nnx.jit
def _logits_and_grads(model: Decoder, tokens, attention_mask):
  """Logits and the gradient of the mean next-token NLL of the real tokens by every parameter."""

  def loss(model):
    logits = model(tokens[:, :-1], attention_mask=attention_mask[:, :-1])
    logprobs = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]
    weights = attention_mask[:, 1:] * attention_mask[:, :-1]
    return -jnp.sum(picked * weights) / jnp.sum(weights), logits

  (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return logits, grads


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_model_logits_and_loss_gradient_equal_the_dense_models(remat, monkeypatch):
  monkeypatch.setattr(attention, "FLASH_BLOCK", 64)  # Three blocks over the 149 inputs.
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, CONFIG.vocab_size, (3, LENGTH))
  attention_mask = (np.arange(LENGTH)[None] < np.array([[LENGTH], [77], [140]])).astype(np.int32)
  logits, grads = _logits_and_grads(_model("flash", remat), tokens, attention_mask)
  ref_logits, ref_grads = _logits_and_grads(_model("dense", remat), tokens, attention_mask)
  real = attention_mask[:, :-1].astype(bool)
  scale = float(jnp.max(jnp.abs(ref_logits)))
  # The decoder's error model (L layers, the widest dot K) with attention's sum over the row.
  atol = tolerances.reordered_logits(CONFIG.num_layers, max(CONFIG.intermediate_size, LENGTH),
                                     scale)
  np.testing.assert_allclose(
      np.asarray(logits)[real],
      np.asarray(ref_logits)[real], rtol=0, atol=atol)
  # A weight's gradient sums the same per-token errors over the batch's tokens.
  relative = tolerances.reordered_sum(CONFIG.num_layers * max(CONFIG.intermediate_size, LENGTH) *
                                      int(real.sum()))

  def check(path, grad, ref):
    np.testing.assert_allclose(grad, ref, rtol=0, atol=relative * float(jnp.max(jnp.abs(ref))),
                               err_msg=jax.tree_util.keystr(path))

  jax.tree_util.tree_map_with_path(check, nnx.state(grads), nnx.state(ref_grads))


def _decode_inputs(batch: int, slots: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
  """q [B, H, D] and a layer's cache [B, K, S, D] as f32 bits, values as in `_inputs`."""
  keys = jax.random.split(jax.random.key(seed), 3)
  uniform = lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0)
  q = 2.0 * uniform(keys[0], (batch, heads, head_dim))
  k = 2.0 * uniform(keys[1], (batch, kv_heads, slots, head_dim))
  v = uniform(keys[2], (batch, kv_heads, slots, head_dim))
  return q, k, v


def _dense_decode(q, k, v, visible):
  """The reference: dense attention of one query per row over the slots [0, visible[b])."""
  mask = jnp.arange(k.shape[2])[None, None, :] < visible[:, None, None]
  return attention.dense_attention(q[:, None], k, v, mask, jnp.float32)[:, 0]


@pytest.mark.parametrize("heads, kv_heads, chunk", [(6, 2, 16), (4, 4, 64), (4, 1, 150)])
def test_decode_attention_reads_each_row_s_slots_like_dense_attention(heads, kv_heads, chunk):
  # 150 slots: with chunk 16 a row's last chunk runs past the end and is read shifted back;
  # rows hold 1 slot, a whole chunk, a chunk and one, the whole cache, and a ragged middle, so
  # one loop step takes chunks of several rows and several chunks of one row.
  visible = jnp.asarray([1, 16, 17, LENGTH, 97], jnp.int32)
  q, k, v = _decode_inputs(5, LENGTH, heads, kv_heads, 8)
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  out = jax.jit(attention.decode_attention,
                static_argnums=(4, 5, 6))(q, bits(k), bits(v), visible, jnp.float32, jnp.float32,
                                          chunk)
  # Error model (module docstring): outputs are convex combinations of at most S values.
  np.testing.assert_allclose(out, _dense_decode(q, k, v, visible), rtol=0,
                             atol=tolerances.reordered_sum(LENGTH))


def test_decode_attention_of_a_row_that_reads_nothing_is_zero_and_others_are_unchanged():
  q, k, v = _decode_inputs(3, 64, 4, 2, 8, seed=1)
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  visible = jnp.asarray([40, 0, 9], jnp.int32)
  out = attention.decode_attention(q, bits(k), bits(v), visible, jnp.float32, jnp.float32, 16)
  np.testing.assert_array_equal(out[1], 0.0)
  reference = _dense_decode(q, k, v, visible)
  np.testing.assert_allclose(out[::2], reference[::2], rtol=0, atol=tolerances.reordered_sum(64))


def test_decode_attention_runs_per_shard_under_a_mesh():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  q, k, v = _decode_inputs(8, 48, 4, 2, 8, seed=2)
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  visible = jnp.asarray([1, 48, 5, 17, 33, 2, 40, 16], jnp.int32)
  place = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  rows = jax.sharding.PartitionSpec(("data", "fsdp"), "tensor", None, None)
  with jax.set_mesh(mesh):
    out = jax.jit(attention.decode_attention,
                  static_argnums=(4, 5, 6))(place(q, jax.sharding.PartitionSpec(("data", "fsdp"))),
                                            place(bits(k), rows), place(bits(v), rows),
                                            place(visible,
                                                  jax.sharding.PartitionSpec(("data", "fsdp"))),
                                            jnp.float32, jnp.float32, 16)
  np.testing.assert_allclose(out, _dense_decode(q, k, v, visible), rtol=0,
                             atol=tolerances.reordered_sum(48))
