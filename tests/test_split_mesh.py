"""A split mesh (mesh.rollout_devices): the sampler on devices of its own, the learner on the
others, the policy copied device to device after each update; on the 8 virtual CPU devices."""

import jax
import numpy as np
import pytest

import tolerances
from agentgym_jax import settings as settings_lib
from agentgym_jax import trainer
from agentgym_jax.sampling import Sampler
from rl_helpers import check_config, echo_config


def _split_config(checkpoint_dir, rollout_devices: int = 4, stale: int = 0):
  c = echo_config(checkpoint_dir, steps=2)
  c.mesh.fsdp = -1
  c.mesh.rollout_devices = rollout_devices
  if stale:
    c.rollout.max_staleness = stale
    c.algorithm.rollout_correction = "decoupled"
  return c


def test_the_split_is_checked(checkpoint_dir):
  c = _split_config(checkpoint_dir)
  c.mesh.rollout_tensor = 3
  check_config(c, "a multiple of mesh.rollout_tensor=3")
  c = _split_config(checkpoint_dir, rollout_devices=8)
  with pytest.raises(settings_lib.ConfigError, match="leaves none of the 8 devices"):
    check_config(c).model.make_mesh()
  settings = check_config(_split_config(checkpoint_dir, rollout_devices=2))
  learner_mesh, rollout_mesh = settings.model.make_mesh(), settings.model.make_rollout_mesh()
  assert dict(learner_mesh.shape) == {"data": 1, "fsdp": 6, "tensor": 1}
  assert dict(rollout_mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1}
  assert set(learner_mesh.devices.flat).isdisjoint(rollout_mesh.devices.flat)
  assert check_config(echo_config(checkpoint_dir)).model.make_rollout_mesh() is None


@pytest.mark.parametrize("stale", [0, 1])
def test_the_sampler_plays_on_its_own_devices_with_each_updates_weights(
    checkpoint_dir, tmp_path, stale, monkeypatch):
  devices = jax.devices()
  seen = []
  generate = Sampler.generate

  def spy(self, state, *args, params=None, **kwargs):
    seen.append((
        {d for x in jax.tree.leaves(state) for d in x.devices()},
        {d for x in jax.tree.leaves(params) for d in x.devices()},
    ))
    return generate(self, state, *args, params=params, **kwargs)

  monkeypatch.setattr(Sampler, "generate", spy)
  history = trainer.train(_split_config(checkpoint_dir, stale=stale), tmp_path / "run")
  assert seen and all(cache == params == set(devices[4:]) for cache, params in seen)
  # The learner's log-probs of the sampled tokens are the sampler's up to f32 rounding at every
  # step of the synchronous run: the sampler read the weights of the update before it. (The
  # tiny model's logits stay below ~7, tolerances.py; its widest dot here is the row.)
  tolerance = tolerances.reordered_logprobs(2, 128, 10.0)
  gaps = [float(row["logprob_gap_max"]) for row in history]
  if stale:
    assert gaps[0] < tolerance < gaps[1]  # Step 2 is played by the policy before update 1.
  else:
    assert max(gaps) < tolerance
  assert all(np.isfinite(row["loss"]) for row in history)
