"""Dynamic sampling (DAPO): which groups a step keeps, the rounds it plays, the task cursor, and
a resumed run that continues exactly as an uninterrupted one."""

import dataclasses

import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import checkpoint, metrics, rollout, task_sampling, trainer
from environments.base import ENV_ERROR
from rl_helpers import assert_resumed_run_matches, check_config, echo_config


def _trajectory(task_id, reward, termination="done"):
  return rollout.Trajectory(task_id=task_id, group=0, turn_rewards=[reward],
                            termination=termination)


def test_a_group_has_signal_when_the_rewards_entering_the_loss_differ():
  same = [_trajectory(0, 1.0), _trajectory(0, 1.0)]
  assert not trainer.has_signal(same, rollout.EpisodeScoring("exclude"))
  assert trainer.has_signal([_trajectory(0, 1.0), _trajectory(0, 0.0)],
                            rollout.EpisodeScoring("exclude"))
  # A failed episode (reward 1 before the env broke) is left out under "exclude": the group's
  # rewards are {1}; under "zero_reward" it counts as 0: {1, 0}.
  failed = [_trajectory(0, 1.0), _trajectory(0, 1.0, termination=ENV_ERROR)]
  assert not trainer.has_signal(failed, rollout.EpisodeScoring("exclude"))
  assert trainer.has_signal(failed, rollout.EpisodeScoring("zero_reward"))


# The fake environment's rewards per task: tasks 0-3 give a group without signal, 4-7 with.
_REWARDS = {
    0: (0.0, 0.0), 1: (1.0, 1.0), 2: (0.0, 0.0), 3: (1.0, 1.0), 4: (0.0, 1.0), 5: (1.0, 0.0),
    6: (0.5, 1.0), 7: (0.0, 0.5)
}


class _FakeEpisodes:
  """`play` for play_step: two samples a task with the rewards above; records its calls."""

  def __init__(self):
    self.calls = []

  def __call__(self, task_ids, round_index):
    self.calls.append((list(task_ids), round_index))
    trajectories = [
        dataclasses.replace(_trajectory(task, reward), group=group)
        for group, task in enumerate(task_ids) for reward in _REWARDS[task]
    ]
    return trajectories, rollout.RolloutStats(generate_s=1.0, env_s=0.5, generated_tokens=10)


def _play(order, *, dynamic_sampling=True, max_rounds=3):
  """A step whose round r plays tasks order[2 r], order[2 r + 1]."""
  play = _FakeEpisodes()
  step = trainer.play_step(play, lambda r: order[2 * r:2 * r + 2], tasks_per_step=2,
                           samples_per_task=2, dynamic_sampling=dynamic_sampling,
                           max_rounds=max_rounds, scoring=rollout.EpisodeScoring())
  return play, step


def test_rounds_are_played_until_enough_groups_have_signal():
  # Round 0 draws tasks 0, 4 (one with signal), round 1 tasks 1, 5 (one more): enough after 2
  # rounds. The batch is tasks 4 and 5, numbered groups 0 and 1, all trained; round r played
  # with round index r.
  play, step = _play([0, 4, 1, 5, 6, 7])
  assert play.calls == [([0, 4], 0), ([1, 5], 1)]
  assert [(t.task_id, t.group) for t in step.batch] == [(4, 0), (4, 0), (5, 1), (5, 1)]
  assert step.trained == [True] * 4
  assert step.rounds == 2 and step.signal_groups == 2
  assert len(step.played) == 8
  assert step.stats.generate_s == 2.0 and step.stats.generated_tokens == 20
  assert step.metrics(2) == {
      "dynamic_sampling/rounds": 2, "dynamic_sampling/kept_fraction": 0.5,
      "dynamic_sampling/filled_groups": 0
  }


def test_extra_groups_with_signal_are_left_out_in_play_order():
  # Round 0: tasks 4 and 0 (one), round 1: tasks 5 and 6 (two more): the first two are kept.
  _, step = _play([4, 0, 5, 6])
  assert [t.task_id for t in step.batch[::2]] == [4, 5]
  assert step.rounds == 2 and step.signal_groups == 3


def test_when_rounds_run_out_groups_without_signal_fill_the_batch_untrained():
  # Three rounds of tasks without signal but one (task 7 in round 1): the batch is task 7, then
  # the first group without signal (task 0), whose rows stay out of the loss.
  _, step = _play([0, 1, 2, 7, 3, 1, 9, 9])
  assert [t.task_id for t in step.batch[::2]] == [7, 0]
  assert step.trained == [True, True, False, False]
  assert step.rounds == 3
  assert step.metrics(2) == {
      "dynamic_sampling/rounds": 3, "dynamic_sampling/kept_fraction": 1 / 6,
      "dynamic_sampling/filled_groups": 1
  }


def test_without_dynamic_sampling_one_round_is_trained_whatever_its_rewards():
  play, step = _play([0, 1, 4, 5], dynamic_sampling=False)
  assert play.calls == [([0, 1], 0)]
  assert [t.task_id for t in step.batch[::2]] == [0, 1]
  assert step.trained == [True] * 4 and step.rounds == 1


def test_a_permutation_steps_rounds_read_the_task_stream_from_the_cursor():
  # Round r of a step starting at cursor c takes the tasks at c + r x count, as a resumed run
  # reads them from the checkpointed cursor.
  order = task_sampling.TaskOrder(list(range(10)), seed=3)
  draw = order.draws(step=7, cursor=6, count=3)
  assert [draw(0), draw(1)] == [order.take(6, 3), order.take(9, 3)]
  assert sorted(order.take(0, 10)) == list(range(10))


def test_dynamic_sampling_keys_are_validated_at_start_up():
  c = config_lib.base_config()
  c.rollout.dynamic_sampling = True
  settings_lib.Settings.from_config(c)
  c.rollout.max_sampling_rounds = 0
  check_config(c, r"rollout.max_sampling_rounds=0 must be >= 1")
  c.rollout.max_sampling_rounds = 2
  c.rollout.samples_per_task = 1
  c.algorithm.advantage = "reinforce_plus_plus"
  check_config(c, r"rollout.dynamic_sampling keeps the groups whose rewards differ")


@pytest.mark.slow
def test_a_resumed_dynamic_sampling_run_matches_an_uninterrupted_one(checkpoint_dir, tmp_path,
                                                                     single_device):
  # The tiny random policy on 2-turn echo: most groups of 8 fail every episode (no signal), so
  # steps need several rounds, the task cursor runs ahead of steps x tasks_per_step, and with
  # at most 2 rounds the first step trains on fewer than 4 groups.
  c = echo_config(checkpoint_dir, steps=4)
  c.rollout.tasks_per_step = 4
  c.rollout.dynamic_sampling = True
  c.rollout.max_sampling_rounds = 2
  c.checkpoint.every = 2
  c.log.trajectories = True
  straight = trainer.train(c, tmp_path / "straight")
  assert_resumed_run_matches(
      straight, c, tmp_path / "resumed",
      ("reward", "loss", "grad_norm", "policy/ratio_mean", "dynamic_sampling/rounds",
       "dynamic_sampling/kept_fraction", "dynamic_sampling/filled_groups"))
  rounds = [row["dynamic_sampling/rounds"] for row in straight]
  assert rounds[0] > 1  # Extra tasks were drawn before the checkpoint at step 2.
  assert straight[0]["dynamic_sampling/filled_groups"] > 0
  # The checkpoints keep the cursor: 4 tasks a round played.
  with checkpoint.Checkpointer(tmp_path / "straight" / "checkpoints") as saved:
    assert [saved.read_meta(step)["task_cursor"] for step in (2, 4)
           ] == [4 * sum(rounds[:2]), 4 * sum(rounds)]
  # Every trained group's rewards differ; a filling group's rows have no advantage (no trained
  # token), and there are as many as the metrics say.
  for step, row in enumerate(straight, start=1):
    groups = {}
    for t in metrics.read_trajectories(tmp_path / "straight", step):
      groups.setdefault(t["group"], []).append(t)
    assert len(groups) == 4 and all(len(g) == 8 for g in groups.values())
    trained = [g for g in groups.values() if g[0]["advantage"] is not None]
    assert all(len({t["reward"] for t in g}) > 1 for g in trained)
    filled = row["dynamic_sampling/filled_groups"]
    assert len(groups) - len(trained) == filled
    # Groups with signal among the 4 x rounds played: the 4 - filled trained ones when short.
    with_signal = round(row["dynamic_sampling/kept_fraction"] * 4 * row["dynamic_sampling/rounds"])
    assert with_signal == 4 - filled if filled else with_signal >= 4
