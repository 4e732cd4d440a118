"""The order in which an RL run's steps draw their training tasks (rollout.task_sampling).

The tasks come from those the step's horizon stage trains on (rollout.curriculum:
`stage_task_orders`) in one of two orders. `TaskOrder` (permutation) is a per-epoch permutation
seeded with (seed, epoch), read from a cursor that advances by the tasks each step draws.
`LearnabilityOrder` (learnability) draws round r of step s seeded with (seed, s, r), each task
with probability proportional to p (1 - p) + floor, p the running estimate of the policy's
success on it (`SuccessEstimates`, updated after every round): the tasks the policy sometimes
solves, whose groups' rewards differ, come first. Both are pure functions of the seed, the step,
the cursor and the estimates, which the checkpoint keeps, so a resumed run draws exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import numpy as np

from agentgym_jax import config as config_lib, evaluation, rollout
from environments.pool import EnvPool


class TaskOrder:
  """An endless, reproducible stream of training task ids: a new permutation every epoch."""

  def __init__(self, task_ids: Sequence[int], seed: int):
    if not task_ids:
      raise ValueError("the environment's train split is empty")
    self.task_ids = np.asarray(task_ids)
    self.seed = seed

  def take(self, cursor: int, count: int) -> list[int]:
    """The `count` tasks starting at position `cursor` of the stream."""
    n = len(self.task_ids)
    out = []
    for position in range(cursor, cursor + count):
      epoch, index = divmod(position, n)
      permutation = np.random.default_rng([self.seed, epoch]).permutation(n)
      out.append(int(self.task_ids[permutation[index]]))
    return out

  def draws(self, step: int, cursor: int, count: int) -> Callable[[int], list[int]]:
    """The tasks of each round of step `step`, which starts at `cursor`: round r takes the
    `count` tasks from cursor + r count."""
    del step  # The cursor says where the step is in the stream.
    return lambda round_index: self.take(cursor + round_index * count, count)


# An unseen task's success estimate: 1/2, where p (1 - p) is largest, so every task is tried.
PRIOR_SUCCESS = 0.5


class SuccessEstimates:
  """A running estimate p of the policy's success on each training task: an exponential moving
  average over the task's visits,

    p <- p + rate (s - p),

  s the fraction of the visit's episodes that succeeded (a round's episodes of the task, those
  whose environment failed left out: they say nothing of the policy). A task not yet visited has
  p = PRIOR_SUCCESS. The estimates are Python floats, so a checkpoint's JSON meta keeps them
  exactly (`to_meta`, `from_meta`).
  """

  def __init__(self, rate: float, success: dict[int, float] | None = None):
    self.rate = rate
    self.success = dict(success or {})

  def __call__(self, task_ids: Sequence[int]) -> np.ndarray:
    """f64[len(task_ids)] the estimates of `task_ids`."""
    return np.asarray([self.success.get(int(t), PRIOR_SUCCESS) for t in task_ids], np.float64)

  def observe(self, trajectories: Sequence[rollout.Trajectory]) -> None:
    """Updates the estimates of the tasks of one round's `trajectories`."""
    outcomes = collections.defaultdict(list)
    for t in trajectories:
      if not t.env_failed:
        outcomes[t.task_id].append(float(t.success))
    for task_id, successes in outcomes.items():
      p = self.success.get(task_id, PRIOR_SUCCESS)
      self.success[task_id] = p + self.rate * (sum(successes) / len(successes) - p)

  def to_meta(self) -> list[list[float]]:
    """The estimates as JSON: [[task id, p], ...] in task order."""
    return [[task_id, p] for task_id, p in sorted(self.success.items())]

  @classmethod
  def from_meta(cls, rate: float, meta: Sequence[Sequence[float]]) -> SuccessEstimates:
    return cls(rate, {int(task_id): float(p) for task_id, p in meta})


def learnability_weights(success: np.ndarray, floor: float) -> np.ndarray:
  """Each task's weight in a learnability draw (Foster et al. 2025, "Learning to Reason at the
  Frontier of Learnability"):

    w = p (1 - p) + floor,

  p (1 - p) the variance of the task's 0/1 success: 1/4 at p = 1/2, 0 for a task the policy
  always or never solves, whose group has equal rewards and so no group-relative signal. The
  floor keeps those reachable, as their p may have changed since they were last played.
  """
  return success * (1.0 - success) + floor


def weighted_order(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """A random order of range(len(weights)) whose first k entries are k draws without
  replacement, each with probability proportional to its weight among those not yet drawn
  (Efraimidis & Spirakis 2006): the indices by decreasing key_i = log(u_i) / w_i, u_i ~ U(0, 1].
  """
  keys = np.log(1.0 - rng.random(len(weights))) / weights
  return np.argsort(-keys, kind="stable")


# Entropy that sets learnability draws apart from the other generators seeded with the seed.
LEARNABILITY_STREAM = 1 << 28


class LearnabilityOrder:
  """Training tasks drawn where the policy sometimes succeeds: round r of step s orders the
  tasks by `weighted_order` of their `learnability_weights`, seeded with (seed, s, r), and takes
  the first `count` that no earlier round of the step drew (once every task was drawn in the
  step, the drawn ones follow in the same order). The estimates are shared by every stage's
  order and updated as rounds are played, so a round's draw depends on the rounds before it."""

  def __init__(self, task_ids: Sequence[int], seed: int, *, estimates: SuccessEstimates,
               floor: float):
    if not task_ids:
      raise ValueError("the environment's train split is empty")
    self.task_ids = np.asarray(task_ids)
    self.seed = seed
    self.estimates = estimates
    self.floor = floor

  def draws(self, step: int, cursor: int, count: int) -> Callable[[int], list[int]]:
    """The tasks of each round of step `step`, as the class docstring draws them; a step's
    rounds are drawn in order, each after the rounds before it were played."""
    del cursor  # The draws are seeded with the step, and the estimates carry the history.
    drawn: set[int] = set()

    def draw(round_index: int) -> list[int]:
      rng = np.random.default_rng([self.seed, LEARNABILITY_STREAM, step, round_index])
      weights = learnability_weights(self.estimates(self.task_ids), self.floor)
      order = [int(t) for t in self.task_ids[weighted_order(weights, rng)]]
      order = [t for t in order if t not in drawn] + [t for t in order if t in drawn]
      tasks = [order[i % len(order)] for i in range(count)]
      drawn.update(tasks)
      return tasks

    return draw


def stage_task_orders(
    pool: EnvPool, curriculum: Sequence[Sequence[str]], seed: int,
    order: Callable[[list[int], int], TaskOrder | LearnabilityOrder] = TaskOrder
) -> list[TaskOrder | LearnabilityOrder]:
  """The training task order of each horizon stage, `order(task_ids, seed)`: the train tasks
  whose category is one of curriculum[stage] (the last entry for later stages), or all of them
  without a curriculum."""
  train = list(pool.task_ids("train"))
  if not curriculum:
    return [order(train, seed)]
  categories = evaluation.task_categories(pool, train)
  orders = []
  for stage, allowed in enumerate(curriculum):
    task_ids = [t for t in train if categories[t] in allowed]
    if not task_ids:
      raise config_lib.ConfigError(
          f"invalid config: rollout.curriculum[{stage}]={tuple(allowed)} matches none of the "
          f"{len(train)} train tasks (their categories: {sorted(set(categories.values()))})")
    orders.append(order(task_ids, seed))
  return orders
