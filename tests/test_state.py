"""What a training loop holds: the optimizer state's shardings and placement."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import state as state_lib
from agentgym_jax import learner, sharding


def test_optimizer_moments_shard_like_their_arrays_and_counters_replicate():
  # jit(optimizer.init) alone gives the moments no sharding: a full replica on every device.
  mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
  params = {"w": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("fsdp", None)))}
  value_head = {"b": jnp.zeros(())}  # Not on the mesh yet: replicated over it.
  trainable = (params, value_head)
  optimizer = learner.make_optimizer(1e-3)
  trainable_shardings, opt_shardings = sharding.train_state_shardings(
      trainable, jax.eval_shape(optimizer.init, trainable), mesh)
  assert trainable_shardings[0]["w"].spec == P("fsdp", None)
  assert trainable_shardings[1]["b"].spec == P()
  opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(trainable)
  leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  moments = [leaf for path, leaf in leaves if leaf.shape == (16, 4)]
  assert len(moments) == 2  # mu and nu
  for moment in moments:
    assert moment.sharding.spec == P("fsdp", None)
    assert moment.addressable_shards[0].data.shape == (2, 4)
  counters = [leaf for path, leaf in leaves if leaf.ndim == 0]
  assert counters and all(leaf.sharding.spec == P() for leaf in counters)

  # optim.offload_state: between updates each device's shard waits in its host memory.
  offloaded = state_lib.place_optimizer_state(opt_state, opt_shardings, on_host=True)
  back = state_lib.place_optimizer_state(offloaded, opt_shardings, on_host=False)
  for stored, original, returned in zip(*map(jax.tree.leaves, (offloaded, opt_state, back))):
    assert stored.sharding.memory_kind == "pinned_host"
    assert stored.sharding.spec == original.sharding.spec
    assert returned.sharding == original.sharding
    np.testing.assert_array_equal(np.asarray(returned), np.asarray(original))
