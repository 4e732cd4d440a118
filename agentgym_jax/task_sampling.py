"""The order in which an RL run's steps draw their training tasks (rollout.task_sampling).

The tasks come from those the step's horizon stage trains on (rollout.curriculum:
`stage_task_orders`) in one of two orders. `TaskOrder` (permutation) is a per-epoch permutation
seeded with (seed, epoch), read from a cursor that advances by the tasks each step draws.
`LearnabilityOrder` (learnability) draws round r of step s seeded with (seed, s, r), each task
with probability proportional to p (1 - p) + floor, p the running estimate of the policy's
success on it (`SuccessEstimates`, updated after every round): the tasks the policy sometimes
solves, whose groups' rewards differ, come first. On a mixture of environments (env.mixture)
`MixtureOrder` picks the environment of each position of the task stream by weight and takes
that environment's next task in its own order of either kind (`mixture_order`). All are pure
functions of the seed, the step, the cursor and the estimates, which the checkpoint keeps, so a
resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import abc
import collections
from typing import Callable, Mapping, Sequence

import numpy as np

from agentgym_jax import config as config_lib, evaluation, rollout
from environments.mixture import MixturePool
from environments.pool import EnvPool


class _Rounds(abc.ABC):
  """What the task orders share: `draws`, the rounds of a step, from each order's `pick`."""

  @abc.abstractmethod
  def pick(self, step: int, round_index: int, position: int, count: int,
           drawn: frozenset[int]) -> list[int]:
    """The `count` tasks of round `round_index` of step `step`, at `position` of the task
    stream, the step's earlier rounds having drawn `drawn`."""

  def draws(self, step: int, cursor: int, count: int) -> Callable[[int], list[int]]:
    """The tasks of each round of step `step`, which starts at `cursor`: round r picks `count`
    tasks at cursor + r count; a step's rounds are drawn in order, each after the rounds before
    it were played."""
    drawn: set[int] = set()

    def draw(round_index: int) -> list[int]:
      tasks = self.pick(step, round_index, cursor + round_index * count, count, frozenset(drawn))
      drawn.update(tasks)
      return tasks

    return draw


class TaskOrder(_Rounds):
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

  def pick(self, step: int, round_index: int, position: int, count: int,
           drawn: frozenset[int]) -> list[int]:
    """The `count` tasks from `position` of the stream, which alone says where a round is."""
    del step, round_index, drawn
    return self.take(position, count)


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


class LearnabilityOrder(_Rounds):
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

  def pick(self, step: int, round_index: int, position: int, count: int,
           drawn: frozenset[int]) -> list[int]:
    """The tasks of round `round_index` of step `step`, as the class docstring draws them."""
    del position  # The draws are seeded with the step, and the estimates carry the history.
    rng = np.random.default_rng([self.seed, LEARNABILITY_STREAM, step, round_index])
    weights = learnability_weights(self.estimates(self.task_ids), self.floor)
    order = [int(t) for t in self.task_ids[weighted_order(weights, rng)]]
    order = [t for t in order if t not in drawn] + [t for t in order if t in drawn]
    return [order[i % len(order)] for i in range(count)]


# Entropy that sets a mixture's draws apart: its picks of environments and their orders' seeds.
MIXTURE_STREAM = 1 << 29
# Positions of a mixture's task stream whose environments one generator picks.
PICK_BLOCK = 1024


def environment_picks(weights: Sequence[float], seed: int, block: int) -> np.ndarray:
  """i64[PICK_BLOCK] the environment of each position of block `block` of a mixture's task
  stream (positions block x PICK_BLOCK on), each picked independently: environment k with
  probability w_k / sum(w), by inverting the cumulative weights at a uniform draw of a
  generator seeded with (seed, MIXTURE_STREAM, block)."""
  cumulative = np.cumsum(np.asarray(weights, np.float64))
  uniform = np.random.default_rng([seed, MIXTURE_STREAM, block]).random(PICK_BLOCK)
  picks = np.searchsorted(cumulative, uniform * cumulative[-1], side="right")
  return np.minimum(picks, len(weights) - 1)  # u x total can round up to the total.


def environment_seed(seed: int, environment: int) -> int:
  """The seed of environment `environment`'s own task order in a mixture of run seed `seed`."""
  return int(np.random.SeedSequence([seed, MIXTURE_STREAM, environment]).generate_state(1)[0])


class MixtureOrder(_Rounds):
  """Training tasks of a mixture of environments: each position of the task stream picks an
  environment by weight (`environment_picks`), and the positions of a round that picked
  environment k take the next tasks of k's own order (`orders[k]`): of a permutation, from k's
  own cursor, the positions before the round's that picked k; of learnability draws, the
  round's. A pure function of the seed, the position, the step and the orders' estimates; the
  picks' counts per block are kept as they are computed."""

  def __init__(self, orders: Sequence[TaskOrder | LearnabilityOrder], weights: Sequence[float],
               seed: int):
    if len(orders) != len(weights):
      raise ValueError(f"{len(orders)} orders need as many weights, got {len(weights)}")
    self.orders = list(orders)
    self.weights = tuple(float(w) for w in weights)
    self.seed = seed
    # Per block b, how many positions before it picked each environment.
    self._before = [np.zeros(len(self.orders), np.int64)]

  def picks(self, position: int, count: int) -> np.ndarray:
    """i64[count] the environments of positions [position, position + count)."""
    first, last = position // PICK_BLOCK, (position + count - 1) // PICK_BLOCK
    blocks = np.concatenate(
        [environment_picks(self.weights, self.seed, b) for b in range(first, last + 1)])
    start = position - first * PICK_BLOCK
    return blocks[start:start + count]

  def counts_before(self, position: int) -> np.ndarray:
    """i64[environments] how many positions before `position` picked each environment."""
    block, offset = divmod(position, PICK_BLOCK)
    while len(self._before) <= block:
      picked = environment_picks(self.weights, self.seed, len(self._before) - 1)
      self._before.append(self._before[-1] + np.bincount(picked, minlength=len(self.orders)))
    picked = environment_picks(self.weights, self.seed, block)[:offset]
    return self._before[block] + np.bincount(picked, minlength=len(self.orders))

  def pick(self, step: int, round_index: int, position: int, count: int,
           drawn: frozenset[int]) -> list[int]:
    """The tasks of the `count` positions from `position`, each of its environment's order."""
    picks, before = self.picks(position, count), self.counts_before(position)
    tasks = [0] * count
    for k, order in enumerate(self.orders):
      slots = np.flatnonzero(picks == k)
      for slot, task in zip(slots, order.pick(step, round_index, int(before[k]), len(slots),
                                              drawn)):
        tasks[slot] = task
    return tasks


def mixture_order(
    pool: MixturePool, weights: Mapping[str, float], seed: int,
    order: Callable[[list[int], int], TaskOrder | LearnabilityOrder] = TaskOrder) -> MixtureOrder:
  """The training task order of a mixture's `pool`: environment k (the k-th label of `weights`,
  label -> weight) picked by weight, its train tasks in `order(task_ids, environment_seed(seed,
  k))`."""
  train: dict[str, list[int]] = collections.defaultdict(list)
  for task_id in pool.task_ids("train"):
    train[pool.environment(task_id).name].append(task_id)
  for label in weights:
    if not train[label]:
      raise config_lib.ConfigError(f"invalid config: env.mixture's {label!r} has no train tasks")
  return MixtureOrder(
      [order(train[label], environment_seed(seed, k)) for k, label in enumerate(weights)],
      list(weights.values()), seed)


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
