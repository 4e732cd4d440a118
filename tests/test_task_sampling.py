"""Learnability task sampling (rollout.task_sampling="learnability"): the weights, weighted draws
without replacement, the running success estimates, the stages of a curriculum, and a resumed
run that draws the tasks an uninterrupted one draws."""

import collections
import functools
import json

import numpy as np
import pytest

from agentgym_jax import checkpoint, config as config_lib, metrics, rollout, task_sampling, trainer
from agentgym_jax import settings as settings_lib
from environments.base import ENV_ERROR
from env_helpers import CategorisedTasks
from rl_helpers import assert_resumed_run_matches, check_config, echo_config


def _episode(task_id, success, termination="done"):
  return rollout.Trajectory(task_id=task_id, group=0, turn_rewards=[float(success)],
                            success=success, termination=termination)


def _order(success, seed=0, task_ids=range(30)):
  estimates = task_sampling.SuccessEstimates(rate=0.5, success=success)
  return task_sampling.LearnabilityOrder(list(task_ids), seed, estimates=estimates, floor=0.01)


def test_a_tasks_weight_is_the_variance_of_its_success_plus_the_floor():
  # p (1 - p) + 0.01: 0.01, 0.25 x 0.75 + 0.01 = 0.1975, 0.26, 0.01.
  np.testing.assert_allclose(
      task_sampling.learnability_weights(np.array([0.0, 0.25, 0.5, 1.0]), 0.01),
      [0.01, 0.1975, 0.26, 0.01])


def test_a_weighted_order_draws_without_replacement_in_proportion_to_the_weights():
  weights = np.array([1.0, 2.0, 3.0, 4.0])
  orders = np.array(
      [task_sampling.weighted_order(weights, np.random.default_rng(s)) for s in range(20000)])
  assert all(sorted(order) == [0, 1, 2, 3] for order in orders[:100])
  # The first is task i with probability w_i / 10; after task 3, the second is task i < 3 with
  # probability w_i / 6.
  first = np.bincount(orders[:, 0], minlength=4) / len(orders)
  np.testing.assert_allclose(first, weights / 10, atol=0.01)
  after_3 = orders[orders[:, 0] == 3]
  second = np.bincount(after_3[:, 1], minlength=4)[:3] / len(after_3)
  np.testing.assert_allclose(second, weights[:3] / 6, atol=0.02)


def test_the_same_seed_step_and_estimates_draw_the_same_tasks():
  success = {t: t / 29 for t in range(30)}
  draw = lambda seed, step, success=success: _order(success, seed).draws(step, 0, 8)(0)
  assert draw(0, 5) == draw(0, 5)
  assert len(set(draw(0, 5))) == 8
  assert draw(1, 5) != draw(0, 5)
  assert draw(0, 6) != draw(0, 5)
  assert draw(0, 5, {t: 0.5 for t in range(30)}) != draw(0, 5)
  # The cursor, which counts the tasks drawn so far, does not enter.
  assert _order(success).draws(5, 123, 8)(0) == draw(0, 5)


def test_tasks_always_or_never_solved_are_drawn_only_through_the_floor():
  # Tasks 0-9 never solved, 10-19 always, 20-29 half the time: weights 0.01, 0.01 and 0.26. A
  # step's first task is one of the 20 with probability 0.2 / 2.8 = 7%, its fifth at most
  # 0.2 / (0.2 + 6 x 0.26) = 11%.
  success = {t: 0.0 if t < 10 else 1.0 if t < 20 else 0.5 for t in range(30)}
  order = _order(success)
  counts = collections.Counter(t for step in range(400) for t in order.draws(step, 0, 5)(0))
  rare = sum(counts[t] for t in range(20))
  assert 0.05 < rare / 2000 < 0.11, rare
  assert min(counts[t] for t in range(20, 30)) > 4 * max(counts[t] for t in range(20))
  assert all(counts[t] > 0 for t in range(20))  # The floor keeps every task in play.


def test_a_steps_rounds_draw_the_tasks_not_yet_drawn_in_the_step_first():
  draw = _order({}, task_ids=range(6)).draws(0, 0, 4)
  first, second = draw(0), draw(1)
  assert len(set(first)) == 4
  # Two tasks are left: they come first, then two of round 0's.
  assert set(second[:2]) == set(range(6)) - set(first)
  assert set(second[2:]) < set(first) and len(set(second)) == 4
  # A round of more tasks than the stage has takes them all, in passes of one order.
  many = _order({}, task_ids=range(3)).draws(0, 0, 7)(0)
  assert sorted(many[:3]) == [0, 1, 2] and many[3:6] == many[:3] and many[6] == many[0]


def test_success_estimates_are_moving_averages_over_visits():
  estimates = task_sampling.SuccessEstimates(rate=0.5)
  # Task 3 succeeds once in 4: p = 0.5 + 0.5 (0.25 - 0.5) = 0.375. Task 4's one episode failed
  # in its environment, which says nothing of the policy: it stays unseen.
  estimates.observe([_episode(3, True)] + [_episode(3, False)] * 3 +
                    [_episode(4, False, termination=ENV_ERROR)])
  assert estimates.success == {3: 0.375}
  np.testing.assert_array_equal(estimates([3, 4]), [0.375, 0.5])
  # Its next visit succeeds every time: 0.375 + 0.5 (1 - 0.375) = 0.6875.
  estimates.observe([_episode(3, True)] * 2)
  assert estimates.success == {3: 0.6875}
  # A checkpoint's JSON meta keeps them exactly (1/3 has no short decimal form).
  estimates.observe([_episode(7, True)] + [_episode(7, False)] * 2)
  restored = task_sampling.SuccessEstimates.from_meta(0.5,
                                                      json.loads(json.dumps(estimates.to_meta())))
  assert restored.success == estimates.success and restored.success[7] == 0.5 + 0.5 * (1 / 3 - 0.5)


def test_each_curriculum_stage_draws_by_learnability_from_its_categories():
  pool = CategorisedTasks({0: "depth1", 1: "depth2", 2: "depth1", 3: "depth3", 4: "depth2"})
  estimates = task_sampling.SuccessEstimates(rate=0.5, success={1: 1.0})
  order = functools.partial(task_sampling.LearnabilityOrder, estimates=estimates, floor=0.01)
  orders = task_sampling.stage_task_orders(pool, (("depth1",), ("depth1", "depth2")), 7, order)
  assert all(o.estimates is estimates for o in orders)  # One estimate a task, in every stage.
  assert {t for step in range(20) for t in orders[0].draws(step, 0, 2)(0)} == {0, 2}
  drawn = collections.Counter(t for step in range(200) for t in orders[1].draws(step, 0, 1)(0))
  assert set(drawn) == {0, 1, 2, 4}
  assert drawn[1] < min(drawn[0], drawn[2], drawn[4]) / 4  # Always solved: only the floor.


@pytest.mark.parametrize("key, value, message", [
    ("task_sampling", "uniform",
     r"rollout.task_sampling='uniform' is not 'permutation' or 'learnability'"),
    ("task_sampling_floor", 0.0, r"rollout.task_sampling_floor=0.0 must be > 0"),
    ("task_sampling_rate", 0.0, r"rollout.task_sampling_rate=0.0 must be in \(0, 1\]"),
    ("task_sampling_rate", 1.5, r"rollout.task_sampling_rate=1.5 must be in \(0, 1\]"),
])
def test_task_sampling_keys_are_validated_at_start_up(key, value, message):
  c = config_lib.base_config()
  c.rollout.task_sampling = "learnability"
  settings_lib.Settings.from_config(c)
  c.rollout[key] = value
  check_config(c, message)


@pytest.mark.slow
def test_a_resumed_learnability_run_draws_the_tasks_of_an_uninterrupted_one(
    checkpoint_dir, tmp_path, single_device):
  # 8 echo tasks, 4 a step in up to 2 rounds of dynamic sampling: tasks come back, and the
  # estimates of the random policy's rare successes steer the draws. Resumed from step 2, the
  # run restores them from the checkpoint and draws what the uninterrupted run drew.
  c = echo_config(checkpoint_dir, steps=4)
  c.env.options.num_train = 8
  c.rollout.tasks_per_step = 4
  c.rollout.task_sampling = "learnability"
  c.rollout.dynamic_sampling = True
  c.rollout.max_sampling_rounds = 2
  c.checkpoint.every = 2
  c.log.trajectories = True
  straight = trainer.train(c, tmp_path / "straight")
  assert_resumed_run_matches(straight, c, tmp_path / "resumed",
                             ("reward", "success", "loss", "dynamic_sampling/rounds"))

  def tasks(workdir):
    return [[t["task_id"] for t in metrics.read_trajectories(workdir, step)] for step in (3, 4)]

  assert tasks(tmp_path / "resumed") == tasks(tmp_path / "straight")
  saved = {}
  for run in ("straight", "resumed"):
    with checkpoint.Checkpointer(tmp_path / run / "checkpoints") as checkpointer:
      saved[run] = [checkpointer.read_meta(step)["task_success"] for step in (2, 4)]
  assert saved["resumed"] == saved["straight"]
  assert len(saved["straight"][1]) == 8  # Every task was played by step 4.
  assert any(p != task_sampling.PRIOR_SUCCESS for _, p in saved["straight"][1])
