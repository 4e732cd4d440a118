"""The mesh, the logical rules table, sharded weight loading and the sharded forward/backward.

Runs on the 8 virtual CPU devices of tests/conftest.py as a (data=2, fsdp=2, tensor=2) mesh. The
tiny Qwen2 model has every dimension the mesh splits divisible by 2 (heads 8, kv heads 4, hidden
256, mlp 512, vocab 512), so each parameter's placement is fully determined by the rules table.
"""

from __future__ import annotations

import math
import re
import tracemalloc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from agentgym_jax import sharding
from agentgym_jax.models import weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder
from agentgym_jax import memory

import tolerances

CONFIG = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512,
                     num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, rope_theta=1e6,
                     attention_bias=True)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random model written as a Hugging Face checkpoint (f32 safetensors, memory-mapped back)."""
  model = nnx.jit(lambda: Decoder(CONFIG, rngs=nnx.Rngs(0)))()
  # Biases are zero at init; random ones make a misplaced bias visible.
  model.layers.q_bias[...] = jax.random.normal(jax.random.key(1), model.layers.q_bias.shape)
  directory = tmp_path_factory.mktemp("tiny_qwen2")
  weights.save_hf(model, directory, dtype=jnp.float32)
  return directory


@pytest.fixture(scope="module")
def unsharded(checkpoint):
  return weights.load_params(weights.abstract_model(CONFIG), weights.SafetensorsReader(checkpoint))


@pytest.fixture(scope="module")
def sharded(checkpoint, mesh):
  return weights.load_params(weights.abstract_model(CONFIG), weights.SafetensorsReader(checkpoint),
                             mesh)


def _params(model: Decoder) -> dict[str, jax.Array]:
  return {
      ".".join(str(k) for k in path): v[...]
      for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }


def test_load_params_places_each_parameter_with_its_logical_sharding(sharded, unsharded, mesh):
  params = _params(sharded)
  expected_specs = {
      "embed_tokens": P("tensor", "fsdp"),  # (vocab, embed)
      "lm_head": P("fsdp", "tensor"),  # (embed, vocab)
      "final_norm": P(None),
      "layers.q_proj": P(None, "fsdp", "tensor", None),  # (layers, embed, heads, head_dim)
      "layers.k_proj": P(None, "fsdp", "tensor", None),
      "layers.o_proj": P(None, "tensor", None, "fsdp"),  # (layers, heads, head_dim, embed)
      "layers.q_bias": P(None, "tensor", None),
      "layers.gate_proj": P(None, "fsdp", "tensor"),  # (layers, embed, mlp)
      "layers.down_proj": P(None, "tensor", "fsdp"),  # (layers, mlp, embed)
  }
  for name, spec in expected_specs.items():
    assert params[name].sharding.spec == spec, name
  reference = _params(unsharded)
  abstract_shardings = sharding.state_shardings(
      nnx.state(weights.abstract_model(CONFIG), nnx.Param), mesh)
  for name, variable in nnx.to_flat_state(abstract_shardings):
    name = ".".join(str(k) for k in name)
    array = params[name]
    assert array.sharding == variable.get_value(), name
    # Each device holds exactly its block of the global array, nothing more.
    shard_shape = array.sharding.shard_shape(array.shape)
    assert len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
      assert shard.data.shape == shard_shape, name
      np.testing.assert_array_equal(np.asarray(shard.data),
                                    np.asarray(reference[name])[shard.index])
  # q_proj [2, 256, 8, 32] is split 2-way on embed (fsdp) and heads (tensor), replicated on data.
  assert params["layers.q_proj"].addressable_shards[0].data.shape == (2, 128, 4, 32)


def _loss(model: Decoder, input_ids: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, the shape of every RL loss's log-prob term."""
  logits = model(input_ids)[:, :-1]
  targets = input_ids[:, 1:]
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(log_probs, targets[..., None], -1).mean()


@nnx.jit
def _forward_and_grads(model: Decoder, input_ids: jax.Array):
  logits = model(input_ids)
  loss, grads = nnx.value_and_grad(_loss)(model, input_ids)
  return logits, loss, grads


# 15 tokens: the residual stream's sequence split over tensor=2 pads the last shard.
@pytest.mark.slow
@pytest.mark.parametrize("length", [16, 15])
def test_sharded_forward_and_backward_equal_unsharded(sharded, unsharded, mesh, length):
  input_ids = np.random.RandomState(0).randint(0, CONFIG.vocab_size, (4, length))
  logits, loss, grads = _forward_and_grads(unsharded, jnp.asarray(input_ids))
  with jax.set_mesh(mesh):
    batch = jax.device_put(input_ids, sharding.batch_sharding(mesh, 2))
    sharded_logits, sharded_loss, sharded_grads = _forward_and_grads(sharded, batch)
  # The logits stay split: batch over (data, fsdp), vocab over tensor.
  assert sharded_logits.sharding.spec == P(("data", "fsdp"), None, "tensor")
  # Sharding changes only where sums are split and in which order partial sums are added: the
  # reordering error model (tests/tolerances.py), for the logits, the loss (a mean of log-probs)
  # and each gradient relative to its own scale; the widest sum is the MLP's, and the weight
  # gradients' sums over the batch's 4 x 16 tokens are shorter.
  layers, widest = CONFIG.num_layers, CONFIG.intermediate_size
  logits_scale = float(jnp.abs(logits).max())
  np.testing.assert_allclose(np.asarray(sharded_logits), np.asarray(logits), rtol=0,
                             atol=tolerances.reordered_logits(layers, widest, logits_scale))
  np.testing.assert_allclose(float(sharded_loss), float(loss), rtol=0,
                             atol=tolerances.reordered_logprobs(layers, widest, logits_scale))
  for (path, grad), (_, sharded_grad) in zip(nnx.to_flat_state(grads),
                                             nnx.to_flat_state(sharded_grads)):
    scale = float(jnp.abs(grad[...]).max())
    np.testing.assert_allclose(np.asarray(sharded_grad[...]), np.asarray(grad[...]), rtol=0,
                               atol=tolerances.reordered_logits(layers, widest,
                                                                scale), err_msg=str(path))


def test_full_remat_keeps_each_device_s_slice_of_the_residual_stream(mesh):
  """The [layers, rows, tokens, hidden] stack the backward keeps is split along the tokens over
  tensor (padded: 15 tokens make shards of 8), so each tensor device holds half of it."""
  graphdef, params = memory.abstract_params(CONFIG, mesh, dtype=jnp.float32, remat="full")
  input_ids = jax.ShapeDtypeStruct((4, 15), jnp.int32, sharding=sharding.batch_sharding(mesh, 2))
  loss = lambda params, input_ids: nnx.merge(graphdef, params)(input_ids).mean()
  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss)).lower(params, input_ids).compile().as_text()
  # Per device: 2 layers, 4 rows over data x fsdp = 4, 15 tokens over tensor = 2, hidden 256.
  assert set(re.findall(r"f32\[2,1,\d+,256\]", text)) == {"f32[2,1,8,256]"}


def test_heads_the_tensor_axis_does_not_divide_stay_whole_and_the_forward_matches(mesh):
  # SmolLM2-135M's head layout (9 query heads over 3 kv heads, tied embeddings) at a tiny width.
  config = ModelConfig(model_type="llama", vocab_size=256, hidden_size=96, intermediate_size=128,
                       num_layers=2, num_heads=9, num_kv_heads=3, head_dim=16,
                       tie_word_embeddings=True)
  model = nnx.jit(lambda: Decoder(config, rngs=nnx.Rngs(0)))()
  sharded = weights.load_params(weights.abstract_model(config), weights.to_hf_state_dict(model),
                                mesh)
  assert sharded.layers.q_proj[...].sharding.spec == P(None, "fsdp", None, None)
  assert sharded.layers.k_proj[...].sharding.spec == P(None, "fsdp", None, None)
  assert sharded.layers.gate_proj[...].sharding.spec == P(None, "fsdp", "tensor")
  input_ids = np.random.RandomState(0).randint(0, config.vocab_size, (4, 8))
  forward = nnx.jit(lambda model, ids: model(ids))
  with jax.set_mesh(mesh):
    sharded_logits = forward(sharded, jax.device_put(input_ids, sharding.batch_sharding(mesh, 2)))
  logits = np.asarray(forward(model, jnp.asarray(input_ids)))
  atol = tolerances.reordered_logits(config.num_layers, config.intermediate_size,
                                     float(np.abs(logits).max()))
  np.testing.assert_allclose(np.asarray(sharded_logits), logits, atol=atol, rtol=0)


def test_logical_rules_map_names_to_mesh_axes():
  assert sharding.logical_to_spec(("batch", "seq", "activation_embed")) == P(("data", "fsdp"), None,
                                                                             None)
  assert sharding.logical_to_spec(
      ("layers", "embed", "heads", "head_dim")) == P(None, "fsdp", "tensor", None)
  # A mesh axis is used at most once per array: "mlp" would also want tensor.
  assert sharding.logical_to_spec(("heads", "mlp")) == P("tensor", None)


def test_logical_rules_fall_back_to_replication_where_the_mesh_does_not_divide(mesh):
  # SmolLM2-135M's k_proj [layers=30, embed=576, kv_heads=3, head_dim=64]: 3 kv heads do not
  # split over tensor=2, so they stay whole; embed 576 = 2 * 288 still splits over fsdp.
  assert sharding.logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (30, 576, 3, 64),
                                  mesh) == P(None, "fsdp", None, None)
  # A batch of 6 does not split over data * fsdp = 4.
  assert sharding.logical_to_spec(("batch", "seq"), (6, 16), mesh) == P(None, None)
  assert sharding.logical_to_spec(("batch", "seq"), (8, 16), mesh) == P(("data", "fsdp"), None)
  # The residual stream's tokens split even where the mesh does not divide them (padded).
  assert sharding.logical_to_spec(("batch", "residual_seq", "activation_embed"), (8, 15, 256),
                                  mesh) == P(("data", "fsdp"), "tensor", None)
  # Mesh axes of size 1 are dropped: on (1, 8, 1) a batch splits over fsdp alone.
  fsdp_only = sharding.make_mesh(data=1, fsdp=8, tensor=1)
  assert sharding.logical_to_spec(("batch", "vocab"), (8, 512), fsdp_only) == P("fsdp", None)


def test_unknown_logical_axis_is_an_error():
  with pytest.raises(KeyError, match=r"logical axis 'hidden' has no rule"):
    sharding.logical_to_spec(("batch", "hidden"))


@pytest.mark.parametrize("shape, message", [
    ((-1, -1, 1), r"at most one may be -1"),
    ((0, -1, 1), r"must be positive"),
    ((3, -1, 1), r"8 devices do not split into a mesh with data=3"),
    ((2, 2, 1), r"data=2 x fsdp=2 x tensor=1 does not match 8 devices"),
])
def test_make_mesh_rejects_shapes_that_do_not_fit_the_devices(shape, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(*shape)


def test_make_mesh_fills_the_free_axis():
  mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert mesh.axis_names == sharding.MESH_AXES


def test_constrain_is_a_no_op_without_a_mesh_and_a_constraint_with_one(mesh):
  x = jnp.ones((8, 4, 16))
  axes = ("batch", "seq", "activation_mlp")
  assert sharding.constrain(x, axes) is x
  assert "sharding_constraint" not in str(jax.make_jaxpr(lambda x: sharding.constrain(x, axes))(x))
  with jax.set_mesh(mesh):
    constrained = jax.jit(lambda x: sharding.constrain(x * 2, axes))(x)
  assert constrained.sharding.spec == P(("data", "fsdp"), None, "tensor")


def test_each_device_shard_copies_only_its_own_slice(checkpoint, mesh, monkeypatch):
  """Every shard callback copies exactly its block, one source tensor at a time.

  A counting wrapper around the memory-mapped reader records which tensors each callback of
  `jax.make_array_from_callback` touches, and tracemalloc (which sees numpy's buffers) records
  the host memory it allocates. Reading a whole tensor (or all layers) before slicing would
  allocate more than the block.
  """
  reader = weights.SafetensorsReader(checkpoint)
  accessed: list[str] = []

  class CountingSource(dict):

    def __contains__(self, name):
      return name in reader

    def __getitem__(self, name):
      accessed.append(name)
      return reader[name]

  records: list[dict[str, Any]] = []
  make_array = jax.make_array_from_callback

  def recording_make_array(shape, target, data_callback):
    parameter = len({record["parameter"] for record in records})

    def callback(index):
      accessed.clear()
      tracemalloc.reset_peak()
      start = tracemalloc.get_traced_memory()[0]
      block = data_callback(index)
      peak = tracemalloc.get_traced_memory()[1] - start
      records.append(
          dict(parameter=parameter, shape=shape, index=index, block=block, peak=peak,
               accessed=list(accessed)))
      return block

    return make_array(shape, target, callback)

  monkeypatch.setattr(jax, "make_array_from_callback", recording_make_array)
  tracemalloc.start()
  try:
    model = weights.load_params(weights.abstract_model(CONFIG), CountingSource(), mesh)
  finally:
    tracemalloc.stop()

  params = _params(model)
  # One callback per device and parameter; jax asks once for a fully replicated one (norms).
  assert len(records) == sum(1 if p.sharding.is_fully_replicated else 8 for p in params.values())
  copied_bytes = dict.fromkeys(range(len(params)), 0)
  for record in records:
    block, names = record["block"], record["accessed"]
    assert block.shape == tuple(
        len(range(*s.indices(n))) for s, n in zip(record["index"], record["shape"]))
    if names:
      # One parameter's tensors: a global one, or each layer's once, in layer order.
      assert len({re.sub(r"layers\.\d+\.", "", name) for name in names}) == 1, names
      layers = [int(m.group(1)) for m in map(re.compile(r"layers\.(\d+)\.").search, names) if m]
      assert layers in ([], list(range(CONFIG.num_layers))), names
      # The callback allocated its block and little else (Python bookkeeping < 16 KiB): no
      # whole-tensor copy, which for q_proj would be 4 times the block.
      assert record["peak"] <= block.nbytes + 16 * 2**10, names
      copied_bytes[record["parameter"]] += block.nbytes
    else:
      assert record["peak"] <= 16 * 2**10  # A replica reuses the block already copied.
  # Across the mesh each parameter is copied exactly once: data=2 replicas share the copy.
  sizes = {record["parameter"]: math.prod(record["shape"]) * 4 for record in records}
  assert copied_bytes == sizes
