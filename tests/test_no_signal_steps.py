"""Steps without learning signal skip their update (algorithm.skip_no_signal_updates): which
batches have none, as the rewards show it on the host and as the advantages show it on the
device, and runs whose skipped steps leave the state as it was and resume exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import checkpoint, learner, metrics, rl, trainer
from agentgym_jax import state as state_lib
from agentgym_jax.batch import Batch
from rl_helpers import assert_same_tensors, echo_config

GRPO = learner.LossConfig(advantage_estimator="grpo")


def _batch(rewards, groups, trained=None) -> Batch:
  """Rows of 4 tokens, tokens 1-2 trained (none in the rows where `trained` is False)."""
  rows = len(rewards)
  trained = np.ones(rows, bool) if trained is None else np.asarray(trained)
  loss_mask = np.zeros((rows, 4), np.float32)
  loss_mask[trained, 1:3] = 1.0
  zeros = np.zeros((rows, 4))
  return Batch(tokens=zeros.astype(np.int32), loss_mask=loss_mask,
               sampler_logprobs=zeros.astype(np.float32), rewards=np.asarray(rewards, np.float32),
               group_ids=np.asarray(groups, np.int32))


def test_the_rewards_show_no_signal_when_every_trained_group_has_equal_rewards():
  groups = [0, 0, 1, 1]
  assert trainer.no_signal_in_rewards(_batch([1, 1, 0, 0], groups), GRPO)
  assert not trainer.no_signal_in_rewards(_batch([1, 0, 0, 0], groups), GRPO)
  # A group without a trained token (dynamic sampling's filler, an excluded failure) is no
  # signal whatever its rewards.
  assert trainer.no_signal_in_rewards(_batch([1, 0, 0, 0], groups, [False, False, True, True]),
                                      GRPO)
  # Equal rewards whose sum rounds in float32 (8 x 0.7) or is not finite are left to the device.
  assert trainer.no_signal_in_rewards(_batch([0.25] * 8, [0] * 8), GRPO)
  assert not trainer.no_signal_in_rewards(_batch([0.7] * 8, [0] * 8), GRPO)
  assert not trainer.no_signal_in_rewards(_batch([np.nan] * 2, [0] * 2), GRPO)
  # RLOO centres on the group too; GiGPO's step groups and the token-level estimators do not,
  # and neither does a KL penalty in the reward.
  uniform = _batch([1, 1, 0, 0], groups)
  assert trainer.no_signal_in_rewards(uniform, learner.LossConfig(advantage_estimator="rloo"))
  for other in ("gigpo", "reinforce_plus_plus", "gae"):
    assert not trainer.no_signal_in_rewards(uniform, learner.LossConfig(advantage_estimator=other))
  assert not trainer.no_signal_in_rewards(
      uniform, learner.LossConfig(advantage_estimator="rloo", kl_in_reward_coef=0.1))


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_batch_the_rewards_call_without_signal_has_zero_advantages(estimator):
  # Random batches of mostly uniform groups: whenever the host says "no signal", the estimator
  # gives exactly 0 on every trained token (with GRPO's eps = 0 as well).
  rng = np.random.default_rng(0)
  loss = learner.LossConfig(advantage_estimator=estimator)
  options = {"grpo": [{}, {"eps": 0.0}, {"std": "unbiased"}], "rloo": [{}]}[estimator]
  seen = 0
  for _ in range(200):
    size, count = rng.integers(1, 9), rng.integers(1, 5)
    values = rng.choice([0.0, 1.0, 0.5, 0.25, 3.0, 0.7, 0.1], size=count)
    rewards = np.repeat(values, size)
    groups = np.repeat(np.arange(count), size)
    batch = _batch(rewards, groups, rng.random(len(rewards)) < 0.8)
    if not trainer.no_signal_in_rewards(batch, loss):
      continue
    seen += 1
    inputs = jax.tree.map(jnp.asarray, (batch.rewards, batch.loss_mask, batch.group_ids))
    for option in options:
      advantages, _ = rl.get_advantage_estimator(estimator)(*inputs[:2], group_ids=inputs[2],
                                                            num_groups=2 * len(rewards), **option)
      assert not np.any(np.asarray(advantages)[batch.loss_mask > 0]), (rewards, option)
  assert seen > 50


def test_the_device_reads_the_advantages_of_trained_tokens_of_kept_trajectories():
  loss_mask = jnp.asarray([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], jnp.float32)
  zeros = jnp.zeros((3, 3))

  def experience(advantages, kept=(1.0, 1.0, 1.0)):
    return learner.Experience(zeros, zeros, zeros, advantages, zeros, jnp.ones((3, 3)),
                              jnp.asarray(kept))

  assert trainer.no_signal(experience(zeros), loss_mask)
  # Advantages off the trained tokens (row 2 has none; column 2 is the token after row 0's).
  assert trainer.no_signal(experience(zeros.at[2, 0].set(1.0).at[0, 2].set(1.0)), loss_mask)
  assert not trainer.no_signal(experience(zeros.at[1, 1].set(-1e-30)), loss_mask)
  assert not trainer.no_signal(experience(zeros.at[0, 0].set(jnp.nan)), loss_mask)
  # A trajectory the rollout correction drops is out of the loss.
  assert trainer.no_signal(experience(zeros.at[1, 1].set(1.0), kept=(1.0, 0.0, 1.0)), loss_mask)


def test_only_a_loss_whose_gradient_goes_through_the_advantages_can_skip():
  assert trainer.gradient_only_through_advantages(GRPO)
  for loss in (learner.LossConfig(kl_coef=1e-3), learner.LossConfig(entropy_coef=1e-3),
               learner.LossConfig(advantage_estimator="gae", value_coef=0.5)):
    assert not trainer.gradient_only_through_advantages(loss)


def _record_calls(monkeypatch):
  """Counts the experience passes and optimizer updates of the runs that follow."""
  calls = {"experience": 0, "update": 0}
  compute_experience, jit_update_step = learner.compute_experience, learner.jit_update_step

  def experience(*args, **kwargs):
    calls["experience"] += 1
    return compute_experience(*args, **kwargs)

  def jit_counted(*args, **kwargs):
    update_step = jit_update_step(*args, **kwargs)

    def counted(*args, **kwargs):
      calls["update"] += 1
      return update_step(*args, **kwargs)

    return counted

  monkeypatch.setattr(learner, "compute_experience", experience)
  monkeypatch.setattr(learner, "jit_update_step", jit_counted)
  return calls


def _record_states(monkeypatch):
  """The run's state as it starts (key "start") and as each checkpoint saves it (its step), on
  the host."""
  states = {}
  resume, save = state_lib.resume, checkpoint.Checkpointer.save

  def recorded_resume(checkpointer, state):
    state, step, meta = resume(checkpointer, state)
    states["start"] = jax.device_get(state.tree())
    return state, step, meta

  def recorded_save(self, step, state, meta, force=False):
    states[step] = jax.device_get(state)
    return save(self, step, state, meta, force)

  monkeypatch.setattr(state_lib, "resume", recorded_resume)
  monkeypatch.setattr(checkpoint.Checkpointer, "save", recorded_save)
  return states


def _unfinished_episodes_config(checkpoint_dir, steps):
  """Echo episodes of 2 turns capped at 1 turn: none finishes, every reward is 0."""
  c = echo_config(checkpoint_dir, steps=steps)
  c.horizon.turns = 1
  c.algorithm.skip_no_signal_updates = True
  c.checkpoint.every = 1
  c.log.trajectories = True
  return c


# (advantage, KL coefficient, experience passes, updates): GRPO's rewards show the missing
# signal; GiGPO's advantages do, after its experience pass; a KL loss has a gradient anyway.
CASES = [("grpo", 0.0, 0, 0), ("gigpo", 0.0, 1, 0), ("grpo", 1e-3, 1, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["grpo", "gigpo", "grpo_kl"])
def test_a_step_without_signal_skips_its_update_and_leaves_the_state(case, checkpoint_dir, tmp_path,
                                                                     monkeypatch, single_device):
  advantage, kl_coef, experience_passes, updates = case
  c = _unfinished_episodes_config(checkpoint_dir, steps=1)
  c.algorithm.advantage = advantage
  c.algorithm.kl_coef = kl_coef
  calls, states = _record_calls(monkeypatch), _record_states(monkeypatch)
  [row] = trainer.train(c, tmp_path)
  assert row["reward"] == 0.0
  assert calls == {"experience": experience_passes, "update": updates}
  assert row["update/skipped"] == (0.0 if updates else 1.0)
  if updates:
    assert "loss" in row and "grad_norm" in row
    return
  # The update's metrics are absent (the experience pass's too when it did not run); the
  # non-finite counter is the optimizer's, unchanged.
  assert not {"loss", "grad_norm", "policy/ratio_mean", "time/update"} & row.keys()
  assert ("entropy" in row) == (experience_passes == 1)
  assert row["nonfinite_steps"] == 0
  # Parameters and optimizer state (AdamW's moments, its count) bit for bit as they started.
  jax.tree.map(np.testing.assert_array_equal, states[1], states["start"])
  records = metrics.read_trajectories(tmp_path, 1)
  assert {t["advantage"] for t in records if t["num_trained_tokens"]} == {0.0}


@pytest.mark.slow
def test_a_run_resumed_after_skipped_steps_matches_an_uninterrupted_one(
    checkpoint_dir, tmp_path, monkeypatch, single_device):
  # Steps 1-2 cap the 2-turn episodes at 1 turn (no reward, no signal), steps 3-4 at 2 turns,
  # where some of the random policy's episodes succeed. Stopped after step 1 and resumed, the
  # run skips step 2 again and then trains as the uninterrupted one does.
  c = _unfinished_episodes_config(checkpoint_dir, steps=4)
  c.horizon.kind = "stepwise"
  c.horizon.caps = (1, 2)
  c.horizon.every = 2
  c.checkpoint.export_hf = True
  calls, states = _record_calls(monkeypatch), _record_states(monkeypatch)
  straight = trainer.train(c, tmp_path / "straight")
  assert [row["update/skipped"] for row in straight] == [1.0, 1.0, 0.0, 0.0]
  # The steps with signal update: 2 epochs x 2 minibatches each, which move the parameters.
  assert calls == {"experience": 2, "update": 8}
  assert all(0 < row["reward"] < 1 and row["grad_norm"] > 0 for row in straight[2:])
  jax.tree.map(np.testing.assert_array_equal, states[2], states["start"])
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), states[4]["params"],
                       states["start"]["params"])
  assert any(jax.tree.leaves(moved))

  c.steps = 1
  trainer.train(c, tmp_path / "resumed")
  c.steps = 4
  resumed = trainer.train(c, tmp_path / "resumed")
  assert [row["step"] for row in resumed] == [2, 3, 4]
  for a, b in zip(straight[1:], resumed):
    assert a.keys() - {"time"} == b.keys() - {"time"}
    for key in ("reward", "update/skipped", "loss", "grad_norm", "policy/ratio_mean"):
      if key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
  assert [row["update/skipped"] for row in metrics.read_metrics(tmp_path / "resumed")
         ] == [1.0, 1.0, 0.0, 0.0]
  assert_same_tensors(tmp_path / "straight" / "export", tmp_path / "resumed" / "export")
