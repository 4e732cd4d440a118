"""How episodes enter the loss (rollout.EpisodeScoring): per-turn reward placement for the
token-level estimators, truncated episodes failed or masked, DAPO's soft overlong penalty, and
the rollout metrics that say how often each applies."""

import numpy as np
import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import metrics, rl, rollout, trainer
from environments.base import CONTEXT, DONE, ENV_ERROR, ENV_TIMEOUT, HORIZON
from rl_helpers import check_config, echo_config
from test_gigpo import _trajectory

# One row: a prompt (untrained), turn 0's reply (2 tokens), an observation, turn 1's reply (2).
_MASK = np.array([[0, 1, 1, 0, 1, 1]], np.float32)
_TURN_INDEX = np.array([[-1, 0, 0, -1, 1, 1]], np.int32)
_TURN_REWARDS = np.array([[0.5, 1.0]], np.float32)
_OUTCOME = np.array([1.5], np.float32)


def test_each_turn_reward_sits_on_the_last_token_of_its_turn():
  placed = rl.place_turn_rewards(_TURN_REWARDS, _TURN_INDEX, _MASK)
  np.testing.assert_array_equal(placed, [[0, 0, 0.5, 0, 0, 1.0]])
  # A turn whose tokens the loss does not train (a dynamic-sampling filler) gets nothing.
  np.testing.assert_array_equal(rl.place_turn_rewards(_TURN_REWARDS, _TURN_INDEX, 0 * _MASK), 0)


def test_reinforce_plus_plus_returns_credit_each_turn_with_what_it_and_later_turns_earned():
  turns = dict(turn_index=_TURN_INDEX, turn_rewards=_TURN_REWARDS)
  placed = rl.reinforce_plus_plus_advantages(_OUTCOME, _MASK, reward_placement="turn", gamma=0.9,
                                             **turns)
  # Trained tokens' rewards (0, 0.5, 0, 1): G4 = 1, G3 = 0.9, G2 = 0.5 + 0.81, G1 = 0.9 G2.
  np.testing.assert_allclose(placed.returns, [[0, 1.179, 1.31, 0, 0.9, 1.0]], rtol=1e-6)
  # Outcome placement: 1.5 on the last token, discounted back.
  outcome = rl.reinforce_plus_plus_advantages(_OUTCOME, _MASK, gamma=0.9, **turns)
  np.testing.assert_allclose(outcome.returns, [[0, 1.0935, 1.215, 0, 1.35, 1.5]], rtol=1e-6)
  # Undiscounted, the first token's return is the outcome either way.
  first = [
      rl.reinforce_plus_plus_advantages(_OUTCOME, _MASK, reward_placement=p, **turns).returns[0, 1]
      for p in rl.REWARD_PLACEMENTS
  ]
  np.testing.assert_allclose(first, [1.5, 1.5])


def test_gae_takes_the_turn_rewards_as_its_step_rewards():
  values = np.array([[0, 0.2, 0.4, 0, 0.6, 0.8]], np.float32)
  out = rl.gae_advantages(_OUTCOME, _MASK, values, reward_placement="turn", turn_index=_TURN_INDEX,
                          turn_rewards=_TURN_REWARDS, gamma=0.9, lam=0.8)
  # Over the trained tokens, r = (0, 0.5, 0, 1), V = (0.2, 0.4, 0.6, 0.8):
  #   delta = (0.16, 0.64, 0.12, 0.2); A_k = delta_k + 0.72 A_{k+1} = (0.7576576, 0.83008,
  #   0.264, 0.2); returns A + V.
  np.testing.assert_allclose(out.returns, [[0, 0.9576576, 1.23008, 0, 0.864, 1.0]], rtol=1e-6)


def test_turn_placement_needs_the_turns_and_a_known_name():
  with pytest.raises(ValueError, match="needs `turn_index` and `turn_rewards`"):
    rl.reinforce_plus_plus_advantages(_OUTCOME, _MASK, reward_placement="turn")
  with pytest.raises(ValueError, match="reward_placement='last' is not one of"):
    rl.reinforce_plus_plus_advantages(_OUTCOME, _MASK, reward_placement="last")


@pytest.mark.parametrize("key, value, message", [
    ("reward_placement", "turn", r"algorithm.reward_placement='turn' needs a token-level "
     r"estimator, one of \['gae', 'reinforce_plus_plus'\]; 'grpo' scores the outcome"),
    ("reward_placement", "step", r"algorithm.reward_placement='step' is not one of"),
    ("truncated_episodes", "drop", r"algorithm.truncated_episodes='drop' is not 'fail' or 'mask'"),
    ("overlong_buffer.length", 513, r"algorithm.overlong_buffer.length=513 must be in \[0, "
     r"rollout.max_new_tokens = 512\]"),
    ("overlong_buffer.penalty_factor", -1.0, r"penalty_factor=-1.0 must be >= 0"),
])
def test_the_scoring_keys_are_checked_at_start_up(key, value, message):
  c = config_lib.base_config()
  *groups, name = f"algorithm.{key}".split(".")
  target = c
  for group in groups:
    target = target[group]
  target[name] = value
  check_config(c, message)


def _episode(reward, termination=DONE, replies=((2, 1),)):
  """A one-group episode of len(replies) turns, the last one's reward `reward`."""
  turns = [([7], list(reply), reward if k == len(replies) - 1 else 0.0)
           for k, reply in enumerate(replies)]
  return _trajectory(0, turns, termination=termination)


def _grpo(batch):
  return np.asarray(
      rl.grpo_advantages(batch.rewards, batch.loss_mask, batch.group_ids,
                         num_groups=2 * len(batch.rewards)))


def test_a_masked_truncation_leaves_the_loss_and_its_groups_baseline():
  won, lost, cut = _episode(1.0), _episode(0.0), _episode(0.0, HORIZON)
  failed = rollout.pack([won, lost, cut])
  masking = rollout.EpisodeScoring(truncated_episodes="mask")
  masked = rollout.pack([won, lost, cut], scoring=masking)
  # "fail": the cut episode is a failure of the group {1, 0, 0}.
  assert failed.loss_mask[2].any() and failed.group_ids[2] == 0
  # "mask": no loss, a group of its own (rows + its index), and the others' advantages those
  # of {1, 0} alone.
  assert not masked.loss_mask[2].any() and masked.group_ids[2] == 3 + 2
  assert not masked.turn_rewards[2].any()
  alone = rollout.pack([won, lost])
  np.testing.assert_array_equal(_grpo(masked)[:2], _grpo(alone))
  assert not np.array_equal(_grpo(failed)[:2], _grpo(alone))
  assert trainer.has_signal([won, cut], rollout.EpisodeScoring())
  assert not trainer.has_signal([won, cut], rollout.EpisodeScoring(truncated_episodes="mask"))


@pytest.mark.parametrize(
    "termination, failed, truncated, excluded",
    [
        (HORIZON, "exclude", "fail", False),
        (CONTEXT, "exclude", "mask", True),
        (ENV_TIMEOUT, "zero_reward", "fail", False),  # Under "fail" a timeout is an env failure...
        (ENV_TIMEOUT, "exclude", "fail", True),
        (ENV_TIMEOUT, "zero_reward", "mask", True),  # ... and a truncation under "mask".
        (ENV_ERROR, "zero_reward", "mask", False),  # An error is no truncation.
        (DONE, "exclude", "mask", False),
    ])
def test_which_terminations_each_setting_leaves_out(termination, failed, truncated, excluded):
  scoring = rollout.EpisodeScoring(failed, truncated)
  assert scoring.excluded(_episode(0.0, termination)) == excluded
  assert _episode(0.0, termination).truncated == (termination in (HORIZON, CONTEXT, ENV_TIMEOUT))


def _dapo_overlong(length, max_length, cache, factor):
  """DAPO eq. 13 as written, times the penalty factor."""
  if length <= max_length - cache:
    return 0.0
  if length <= max_length:
    return factor * ((max_length - cache) - length) / cache
  return -factor


@pytest.mark.parametrize("cache, factor", [(4, 1.0), (3, 0.5), (8, 2.0)])
def test_the_overlong_penalty_is_dapos(cache, factor):
  buffer = rollout.OverlongBuffer(cache, factor, max_new_tokens=8)
  for length in range(0, 9):
    assert buffer.penalty(length) == pytest.approx(_dapo_overlong(length, 8, cache, factor))
  assert buffer.penalty(8) == pytest.approx(-factor)


def test_the_overlong_penalty_joins_each_turns_reward():
  scoring = rollout.EpisodeScoring(overlong=rollout.OverlongBuffer(2, 1.0, max_new_tokens=4))
  # Replies of 4, 2 and 3 tokens: penalties -1, 0 and -0.5; rewards 0, 0 and 1.
  episode = _episode(1.0, replies=((3, 3, 3, 1), (4, 1), (5, 5, 1)))
  assert episode.reply_lengths() == [4, 2, 3]
  assert scoring.turn_rewards(episode) == [-1.0, 0.0, 0.5]
  batch = rollout.pack([episode], scoring=scoring)
  np.testing.assert_array_equal(batch.turn_rewards, [[-1.0, 0.0, 0.5]])
  np.testing.assert_array_equal(batch.rewards, [-0.5])
  # Without a buffer the environment's rewards, unchanged.
  np.testing.assert_array_equal(rollout.pack([episode]).turn_rewards, [[0.0, 0.0, 1.0]])
  assert scoring.metrics([episode]) == pytest.approx({
      **rollout.EpisodeScoring().metrics([episode]), "rollout/overlong_penalty": -1.5,
      "rollout/overlong_replies": 2 / 3
  })


def test_the_metrics_count_truncations_by_reason_and_what_the_loss_leaves_out():
  episodes = [
      _episode(1.0),
      _episode(0.0, HORIZON),
      _episode(0.0, HORIZON),
      _episode(0.0, ENV_TIMEOUT)
  ]
  assert rollout.EpisodeScoring(truncated_episodes="mask").metrics(episodes) == {
      "rollout/truncated_fraction": 0.75,
      "rollout/excluded_fraction": 0.75,
      "rollout/truncated_fraction/horizon": 0.5,
      "rollout/truncated_fraction/context": 0.0,
      "rollout/truncated_fraction/env_timeout": 0.25,
  }
  assert rollout.EpisodeScoring("zero_reward").metrics(episodes)["rollout/excluded_fraction"] == 0


@pytest.mark.slow
def test_a_masked_run_leaves_its_cut_episodes_out_of_the_loss(checkpoint_dir, tmp_path,
                                                              single_device):
  # 2-turn echo capped at 1 turn: an episode whose first reply is right is cut by the cap, one
  # whose reply is wrong ends (done, failed). Masked, the cut ones carry no advantage.
  c = echo_config(checkpoint_dir, steps=1)
  config_lib.fixed_horizon(1)(c)
  c.algorithm.truncated_episodes = "mask"
  c.checkpoint.every = 0
  c.log.trajectories = True
  [row] = trainer.train(c, tmp_path)
  assert row["rollout/truncated_fraction/horizon"] > 0
  assert row["rollout/excluded_fraction"] == row["rollout/truncated_fraction"]
  records = metrics.read_trajectories(tmp_path, 1)
  assert {r["termination"] for r in records} == {DONE, HORIZON}
  for record in records:
    assert (record["advantage"] is None) == (record["termination"] == HORIZON)
