"""Mixed-environment runs (env.mixture): run-wide task ids, one pool of every environment's
adapters, draws by weight from (seed, position) and evaluation tables."""

import collections

import pytest

from agentgym_jax import evaluation, recipe, rollout, task_sampling
from environments import base, mixture
from environments.pool import EnvPool, Environment

ECHO_INSTRUCTION = "Repeat each symbol you are shown. Symbols: 0 1."


def _mixture_pool(slots=2, **echo_options):
  """Echo (2 turns) and echo with symbols "ab" (3 turns, capped at 1), as one pool."""
  return mixture.MixturePool([
      Environment("echo", EnvPool("echo", slots, options={"turns": 2, **echo_options})),
      Environment("letters", EnvPool("echo", slots, options={"turns": 3, "symbols": "ab"}), 1),
  ])


# --- task ids and the pool -----------------------------------------------------------------


def test_run_wide_task_ids_name_the_environment_and_its_own_task():
  with _mixture_pool(num_train=3, num_test=2) as pool:
    letters = base.make("echo", turns=3, symbols="ab")
    assert pool.task_ids("test") == [0, 1] + [mixture.STRIDE + t for t in range(100)]
    assert pool.task_ids("train")[:3] == [2, 3, 4]
    assert pool.environment(4).name == "echo"
    assert pool.environment(mixture.STRIDE + 7).name == "letters"
    assert pool.environment(mixture.STRIDE + 7).cap(5) == 1
    assert pool.environment(4).cap(5) == 5
    # Each environment's instruction, asked of its own adapters.
    assert pool.environment(4).pool.instruction == ECHO_INSTRUCTION
    assert pool.environment(mixture.STRIDE).pool.instruction == letters.instruction
    assert letters.instruction != ECHO_INSTRUCTION
    # A task's info is its environment's, the category under the environment's label.
    info = pool.task_info(mixture.STRIDE + 107)
    assert info == {**letters.task_info(107), "category": "letters/echo"}
    with pytest.raises(ValueError, match="task 2000000000 is of component 2; the mixture has 2"):
      pool.task_info(2 * mixture.STRIDE)
  with pytest.raises(ValueError, match=r"ids in \[0, 1000000000\)"):
    mixture.task_id(1, mixture.STRIDE)


def test_each_slot_plays_its_tasks_environment_and_keeps_the_order_of_requests():
  with _mixture_pool(slots=3) as pool:
    letters = base.make("echo", turns=3, symbols="ab")
    task = mixture.STRIDE + 150
    first = pool.reset_async([(0, task), (1, 150), (2, task + 1)]).result()
    assert [r.observation for r in first
           ] == [letters.reset(150),
                 base.make("echo", turns=2).reset(150),
                 letters.reset(151)]
    sequence = letters.task_info(150)["sequence"]
    results = pool.step_async([(1, "0"), (0, sequence[0])]).result()
    assert results[1].observation == sequence[1] and not results[1].done
    # Slot 0 now plays echo: its next step is echo's, on its own adapter.
    pool.reset_async([(0, 150)]).result()
    assert pool.step_async([(0, "x")]).result()[0].observation == "Wrong."
    with pytest.raises(ValueError, match="slot 5 has no episode in progress"):
      pool.step_async([(5, "0")]).result()
    with pytest.raises(ValueError, match="non-negative ints"):
      pool.reset_async([(0, -1)]).result()


def test_a_mixture_refuses_twin_names_and_pools_of_unequal_width():
  echo = lambda slots: EnvPool("echo", slots)
  with pytest.raises(ValueError, match="distinct names"):
    mixture.MixturePool([Environment("echo", echo(2)), Environment("echo", echo(2))])
  with pytest.raises(ValueError, match="the same number of slots"):
    mixture.MixturePool([Environment("a", echo(2)), Environment("b", echo(3))])


# --- draws -----------------------------------------------------------------------------------


def _orders(weights=(3.0, 1.0), seed=0, sizes=(40, 12)):
  """A MixtureOrder of permutations of environments with `sizes` tasks (env k: k * 1000 on)."""
  orders = [
      task_sampling.TaskOrder([k * 1000 + t for t in range(n)],
                              task_sampling.environment_seed(seed, k)) for k, n in enumerate(sizes)
  ]
  return task_sampling.MixtureOrder(orders, weights, seed)


def test_draws_follow_the_weights_deterministically_from_the_seed_and_step():
  draw = lambda order, step: order.draws(step, step * 8, 8)(0)
  order = _orders()
  assert draw(order, 5) == draw(_orders(), 5)
  assert draw(order, 5) != draw(_orders(seed=1), 5)
  # Each task picks environment 0 with probability 3/4: over 8,000 draws the share is within
  # 0.015 (3 standard deviations: sqrt(3/16 / 8000) = 0.0048).
  environments = [t // 1000 for step in range(1000) for t in draw(order, step)]
  assert abs(environments.count(0) / len(environments) - 0.75) < 0.015
  # A step's environments vary: some steps draw both, none is fixed.
  mixes = {tuple(sorted({t // 1000 for t in draw(order, step)})) for step in range(50)}
  assert (0, 1) in mixes


def test_each_environment_reads_its_own_permutation_without_gaps():
  order = _orders()
  drawn = [t for step in range(30) for t in order.draws(step, step * 8, 8)(0)]
  for k, own in enumerate(order.orders):
    mine = [t for t in drawn if t // 1000 == k]
    assert mine == own.take(0, len(mine))  # Epoch after epoch, in its own order.
  # Each environment has an order of its own, not a copy of another's.
  assert [t % 1000 for t in order.orders[0].take(0, 12)] != order.orders[1].take(0, 12)


def test_a_fresh_order_at_a_cursor_draws_what_the_order_that_drew_up_to_it_draws():
  # What a resumed run does: a new order, at the checkpoint's task cursor (past a block of
  # picks), in dynamic sampling's second round.
  played = _orders()
  for step in range(200):
    played.draws(step, step * 8, 8)(0)
  resumed = _orders()
  assert resumed.draws(200, 1600, 8)(1) == played.draws(200, 1600, 8)(1)
  assert resumed.counts_before(1608).tolist() == played.counts_before(1608).tolist()
  assert resumed.counts_before(1608).sum() == 1608


def test_learnability_draws_within_each_environment():
  estimates = task_sampling.SuccessEstimates(rate=0.5, success={0: 1.0, 1: 1.0, 2: 0.5})
  orders = [
      task_sampling.LearnabilityOrder(ids, task_sampling.environment_seed(0, k),
                                      estimates=estimates, floor=0.01)
      for k, ids in enumerate(([0, 1, 2], [1000, 1001]))
  ]
  order = task_sampling.MixtureOrder(orders, (1.0, 1.0), 0)
  drawn = collections.Counter(t for step in range(300) for t in order.draws(step, step, 1)(0))
  # Environment 0's always-solved tasks come only through the floor: 0.01 / 0.27 of its draws.
  assert drawn[2] > 10 * (drawn[0] + drawn[1])
  assert 0.4 < (drawn[1000] + drawn[1001]) / 300 < 0.6
  # A step's second round draws an environment's tasks not yet drawn in the step first.
  rounds = order.draws(7, 0, 4)
  first, second = rounds(0), rounds(1)
  for k, ids in enumerate(([0, 1, 2], [1000, 1001])):
    mine = [t for t in second if t // 1000 == k]
    fresh = [t for t in ids if t not in first]
    assert mine[:len(fresh)] == [t for t in mine if t in fresh]


# --- evaluation ------------------------------------------------------------------


def _episode(task_id, env, success, turns, termination="done", category="all"):
  return rollout.Trajectory(task_id=task_id, group=0, env=env, category=category,
                            turn_rewards=[0.0] * (turns - 1) + [float(success)], success=success,
                            termination=termination)


def _mixed_summary(successes):
  played = [
      _episode(0, "echo", 0 in successes, 1, category="echo/echo"),
      _episode(1, "echo", 1 in successes, 1, category="echo/echo"),
      _episode(mixture.STRIDE, "textcraft", mixture.STRIDE in successes, 2,
               category="textcraft/depth1"),
      _episode(mixture.STRIDE + 1, "textcraft", mixture.STRIDE + 1 in successes, 3,
               category="textcraft/depth2"),
  ]
  return evaluation.summarize(played, {t.task_id: t.category for t in played})


def test_an_evaluation_of_a_mixture_has_a_table_per_environment():
  summary = _mixed_summary({0, mixture.STRIDE})
  assert summary["environments"]["echo"]["avg@k"] == 0.5
  assert summary["environments"]["textcraft"]["categories"]["textcraft/depth1"]["avg@k"] == 1.0
  assert summary["tasks"][2] == {
      "task_id": mixture.STRIDE, "env": "textcraft", "category": "textcraft/depth1",
      "success": [1.0], "reward": [1.0], "turns": [2]
  }
  rows = [line.split() for line in evaluation.format_table(summary).splitlines()[3:]]
  assert [(row[0], row[2]) for row in rows] == [("echo/echo", "50.00%"), ("echo", "50.00%"),
                                                ("textcraft/depth1", "100.00%"),
                                                ("textcraft/depth2", "0.00%"),
                                                ("textcraft", "50.00%"), ("all", "50.00%")]
  assert evaluation.as_metrics(summary)["eval/success/textcraft"] == 0.5
  assert evaluation.as_metrics(summary)["eval/success/textcraft/depth2"] == 0.0
  # The stage table has the same rows, and compares the stages task by task.
  table = recipe.stage_table({"initial": summary, "RL": _mixed_summary({0, 1})})
  assert [line.split()[0] for line in table.splitlines()[3:9]] == [row[0] for row in rows]
  assert "initial -> RL: +1 gained, -1 lost of 4 tasks" in table
  # One environment's evaluation stays as it was: no environments, no env in its records.
  single = evaluation.summarize([_episode(0, "echo", True, 1), _episode(1, "echo", False, 1)], {})
  assert "environments" not in single and "env" not in single["tasks"][0]
