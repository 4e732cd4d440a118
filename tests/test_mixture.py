"""Mixed-environment runs (env.mixture): run-wide task ids, one pool of every environment's
adapters, draws by weight from (seed, position), per-environment metrics, caps, evaluation
tables and config checks; a mixed echo + TextCraft run with the tiny model, and its resume."""

import collections

import numpy as np
import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import evaluation, metrics, recipe, rollout, task_sampling, trainer
from agentgym_jax import settings as settings_lib
from environments import base, mixture
from environments.base import HORIZON
from environments.pool import EnvPool, Environment
from rl_helpers import assert_resumed_run_matches, check_config, echo_config

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


# --- metrics and evaluation ------------------------------------------------------------------


def _episode(task_id, env, success, turns, termination="done", category="all"):
  return rollout.Trajectory(task_id=task_id, group=0, env=env, category=category,
                            turn_rewards=[0.0] * (turns - 1) + [float(success)], success=success,
                            termination=termination)


def test_environment_metrics_are_each_environments_means():
  played = [
      _episode(0, "echo", True, 2),
      _episode(1, "echo", False, 1),
      _episode(5, "textcraft", False, 3, HORIZON),
      _episode(6, "textcraft", False, 3, HORIZON),
      _episode(7, "textcraft", True, 2),
  ]
  assert rollout.environment_metrics(played) == pytest.approx({
      "env/echo/success": 0.5, "env/echo/reward": 0.5, "env/echo/turns": 1.5,
      "env/echo/truncated_fraction": 0.0, "env/echo/episodes": 2.0, "env/textcraft/success": 1 / 3,
      "env/textcraft/reward": 1 / 3, "env/textcraft/turns": 8 / 3,
      "env/textcraft/truncated_fraction": 2 / 3, "env/textcraft/episodes": 3.0
  })


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


def test_an_evaluation_takes_the_first_max_tasks_of_each_environment():
  c = config_lib.base_config()
  c.eval.max_tasks = 2
  plan = settings_lib.Evaluation.from_config(c, 10)
  with _mixture_pool() as pool:
    assert plan.tasks(pool) == [0, 1, mixture.STRIDE, mixture.STRIDE + 1]
  with EnvPool("echo", 1) as pool:
    assert plan.tasks(pool) == [0, 1]


# --- config ----------------------------------------------------------------------------------


def _mixed_config(*components):
  c = config_lib.base_config()
  c.env.name = "mixture"
  c.env.mixture = components or ({"name": "echo", "weight":
      1.0}, {"name": "textcraft", "weight": 2.0, "horizon": 4, "options": {"max_depth": 1}})
  return c


def test_a_mixture_config_becomes_components_and_their_pools():
  settings = check_config(_mixed_config()).env
  assert settings.mixture == (settings_lib.MixtureComponent("echo", "echo", {}, 1.0, None),
                              settings_lib.MixtureComponent("textcraft", "textcraft",
                                                            {"max_depth": 1}, 2.0, 4))
  with settings.pool(3) as pool:
    assert [(e.name, e.pool.num_slots, e.max_turns) for e in pool.components] == [("echo", 3, None),
                                                                                  ("textcraft", 3,
                                                                                   4)]
  # Without a mixture, env.name's pool as before.
  assert settings_lib.EnvSettings.from_config(config_lib.base_config()).mixture == ()


ECHO = {"name": "echo", "weight": 1.0}


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.env, "name", "textcraft"),
     r"env.name='textcraft': a run on env.mixture has env.name='mixture'"),
    (lambda c: setattr(c.env, "mixture", ()), r"env.name='mixture' plays the environments of"),
    (lambda c: setattr(c.env, "mixture", (ECHO, {"name": "chess", "weight": 1.0})),
     r"env.mixture\[1\].name='chess' is not one of"),
    (lambda c: setattr(c.env, "mixture", ({"name": "echo", "weight": 0.0},)),
     r"env.mixture\[0\].weight=0.0 must be a number > 0"),
    (lambda c: setattr(c.env, "mixture", ({"name": "echo"},)),
     r"env.mixture\[0\]=\{'name': 'echo'\} must be a dict with a name and a weight"),
    (lambda c: setattr(c.env, "mixture",
                       (ECHO, ECHO)), r"env.mixture\[1\]: the label 'echo' is another component's"),
    (lambda c: setattr(c.env, "mixture", ({**ECHO, "label": "a/b"},)),
     r"env.mixture\[0\].label='a/b' must be a non-empty string without '/'"),
    (lambda c: setattr(c.env, "mixture", ({**ECHO, "horizon": 0},)),
     r"env.mixture\[0\].horizon=0 must be an integer >= 1"),
    (lambda c: setattr(c.env, "mixture",
                       ({**ECHO, "turns": 2},)), r"env.mixture\[0\] has unknown keys \['turns'\]"),
    (lambda c: setattr(c.env, "mixture", ({**ECHO, "options": {"turn": 2}},)),
     r"env.mixture\[0\].options.turn: environment 'echo' takes no option 'turn'"),
    (lambda c: setattr(c.env, "mixture",
                       ({"name": "textcraft", "weight": 1.0, "options": {"goals": "nope"}},)),
     r"env.mixture\[0\].options.goals='nope' is not one of"),
    (lambda c: setattr(c.env, "action_format", "tool_call"),
     r"env.action_format='tool_call': env 'echo' publishes no tools"),
    (lambda c: setattr(c.env.options, "turns", 2), r"env.options are env.name's adapter's"),
    (lambda c: setattr(c.rollout, "curriculum", (
        ("depth1",),)), r"rollout.curriculum draws from one environment's categories"),
])
def test_a_bad_mixture_fails_at_start_up_with_one_line(change, message):
  c = _mixed_config()
  change(c)
  check_config(c, message)


def test_two_components_of_one_environment_need_their_own_labels():
  c = _mixed_config(ECHO, {**ECHO, "label": "echo3", "options": {"turns": 3}})
  assert [m.label for m in check_config(c).env.mixture] == ["echo", "echo3"]


# --- a mixed run -----------------------------------------------------------------------------


def _echo_and_textcraft(checkpoint_dir, steps):
  """The tiny policy on 2-turn echo and depth-1 TextCraft capped at 1 turn (2 for the step),
  4 tasks x 2 samples a step, every step's trajectories logged."""
  c = echo_config(checkpoint_dir, steps=steps)
  c.env.name = "mixture"
  c.env.options = {}
  c.env.mixture = ({"name": "echo", "weight": 1.0, "options": {"turns": 2}},
                   {"name": "textcraft", "weight": 1.0, "options": {"max_depth": 1}, "horizon": 1})
  c.rollout.max_context = 1024  # A TextCraft prompt is some hundreds of tokens.
  c.rollout.tasks_per_step = 4
  c.rollout.samples_per_task = 2
  c.log.trajectories = True
  return c


def test_a_mixed_run_logs_each_environments_metrics_prompts_and_caps(checkpoint_dir, tmp_path,
                                                                     single_device):
  c = _echo_and_textcraft(checkpoint_dir, steps=2)
  c.eval.every = 2
  c.eval.max_tasks = 1
  history = trainer.train(c, tmp_path)
  textcraft = base.make("textcraft", max_depth=1)
  seen = set()
  for step, row in enumerate(history, start=1):
    played = metrics.read_trajectories(tmp_path, step)
    by_env = collections.defaultdict(list)
    for t in played:
      by_env[t["env"]].append(t)
      # Its own environment's instruction opens each episode, its category under its label.
      environment, own = divmod(t["task_id"], mixture.STRIDE)
      assert t["env"] == ("echo", "textcraft")[environment]
      instruction = ECHO_INSTRUCTION if environment == 0 else textcraft.instruction
      assert t["messages"][0]["content"].startswith(instruction + "\n\n")
      assert t["category"].startswith(t["env"] + "/")
      # TextCraft's own cap of 1 turn, below the step's 2; echo plays to 2.
      assert t["num_turns"] <= (2 if environment == 0 else 1)
      if environment == 1:
        assert t["termination"] == "horizon" and own in textcraft.task_ids("train")
    # Groups stay within one task.
    groups = collections.defaultdict(set)
    for t in played:
      groups[t["group"]].add(t["task_id"])
    assert all(len(tasks) == 1 for tasks in groups.values())
    for name, episodes in by_env.items():
      assert row[f"env/{name}/episodes"] == len(episodes)
      assert row[f"env/{name}/success"] == np.mean([t["success"] for t in episodes])
      assert row[f"env/{name}/turns"] == np.mean([t["num_turns"] for t in episodes])
      assert row[f"env/{name}/truncated_fraction"] == np.mean(
          [t["termination"] == "horizon" for t in episodes])
    assert not {k.split("/")[1] for k in row if k.startswith("env/")} - set(by_env)
    seen |= set(by_env)
  assert seen == {"echo", "textcraft"}
  # The evaluation: the first test task of each environment, each reported.
  assert {"eval/success/echo", "eval/success/textcraft"} <= history[-1].keys()
  assert "eval/success/textcraft/depth1" in history[-1]


@pytest.mark.slow
def test_a_resumed_mixed_run_matches_the_uninterrupted_one(checkpoint_dir, tmp_path, single_device):
  c = _echo_and_textcraft(checkpoint_dir, steps=4)
  c.checkpoint.every = 2
  straight = trainer.train(c, tmp_path / "straight")
  assert_resumed_run_matches(straight, c, tmp_path / "resumed",
                             ("reward", "loss", "env/echo/episodes", "env/textcraft/episodes"))
  for step in (3, 4):
    tasks = lambda run: [t["task_id"] for t in metrics.read_trajectories(tmp_path / run, step)]
    assert tasks("resumed") == tasks("straight")
