"""What both training loops share: the state's shardings and placement, the loss settings."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import config as config_lib
from agentgym_jax import learner, run, sharding


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
  offloaded = run.place_optimizer_state(opt_state, opt_shardings, on_host=True)
  back = run.place_optimizer_state(offloaded, opt_shardings, on_host=False)
  for stored, original, returned in zip(*map(jax.tree.leaves, (offloaded, opt_state, back))):
    assert stored.sharding.memory_kind == "pinned_host"
    assert stored.sharding.spec == original.sharding.spec
    assert returned.sharding == original.sharding
    np.testing.assert_array_equal(np.asarray(returned), np.asarray(original))


def test_the_loss_settings_carry_what_the_estimator_reads_from_the_config():
  c = config_lib.base_config()
  c.algorithm.grpo_std = "unbiased"
  c.algorithm.grpo_eps = 1e-4
  loss = run.Settings.from_config(c).loss
  assert loss.advantage_options == (("eps", 1e-4), ("normalize_by_std", True), ("std", "unbiased"))
  # The in-reward penalty's estimator is its own key, k1 by default, whatever the loss's is.
  assert (loss.kl_estimator, loss.kl_in_reward_estimator) == ("low_var_kl", "k1")
  c.algorithm.advantage = "gae"
  assert run.Settings.from_config(c).loss.advantage_options == (("gamma", 1.0), ("lam", 1.0))
