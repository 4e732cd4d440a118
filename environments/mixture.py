"""Several environments played as one pool (env.mixture): a run-wide task id names an
environment and one of its tasks, and each slot plays whichever environment its episode's task
is of.

Task ids. Component k's task t has the run-wide id k * STRIDE + t, so component 0's tasks keep
their own ids. It is an int, as the adapter protocol's ids are, which trajectory logs,
checkpoints and evaluation JSON keep as it is; it names the environment at a glance
(2000000017 is component 2's task 17); and the splits' ids stay disjoint when each
environment's are. A component's own task ids must be below STRIDE.

Pools. Every component has a pool of its own (environments/pool.py's EnvPool) with the
mixture's `num_slots` slots, their adapters built by the first episode a slot plays of that
environment: slot s plays each episode on slot s of the pool of its task's environment, so a
slot holds at most one adapter of each environment, and a batch of resets or steps runs on all
the component pools at once. Faults, timeouts and the backend are each component pool's.

A task's category is its environment's label, "/", and the category its environment gives it
(e.g. "textcraft/depth1"; "all" if it gives none), so that categories of different
environments never merge.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Sequence

from environments import base
from environments.base import StepResult
from environments.pool import EnvPool, Environment

# Component k's task t is the run-wide task k * STRIDE + t.
STRIDE = 10**9
# A pool's batch call: EnvPool.reset_async or EnvPool.step_async.
_Batch = Callable[[EnvPool, list[tuple[int, Any]]], concurrent.futures.Future]


def task_id(component: int, own: int) -> int:
  """The run-wide id of task `own` of component `component`."""
  if not 0 <= own < STRIDE:
    raise ValueError(f"a mixture's component tasks have ids in [0, {STRIDE}); got {own}")
  return component * STRIDE + own


class MixturePool:
  """The pools of a mixture's environments (`components`, each an Environment whose pool has
  the same number of slots) as one pool of run-wide task ids (module docstring)."""

  def __init__(self, components: Sequence[Environment]):
    if not components:
      raise ValueError("a mixture needs at least one environment")
    names = [component.name for component in components]
    if len(set(names)) != len(names):
      raise ValueError(f"a mixture's environments need distinct names, got {names}")
    slots = {component.pool.num_slots for component in components}
    if len(slots) != 1:
      raise ValueError(f"a mixture's pools need the same number of slots, got {sorted(slots)}")
    self.components = tuple(components)
    self.num_slots = slots.pop()
    self._playing: dict[int, int] = {}  # slot -> the component of the episode it last reset

  def environment(self, task_id: int) -> Environment:
    """The environment task `task_id` is played in."""
    return self.components[self._split(task_id)[0]]

  def task_ids(self, split: str) -> list[int]:
    """Every component's task ids of `split`, run-wide, component by component."""
    base.check_split(split)
    return [
        task_id(k, int(own)) for k, component in enumerate(self.components)
        for own in component.pool.task_ids(split)
    ]

  def task_info(self, task_id: int) -> dict[str, Any]:
    """The task's environment's metadata, its category prefixed by the environment's label."""
    k, own = self._split(task_id)
    component = self.components[k]
    info = dict(component.pool.task_info(own))
    info["category"] = f"{component.name}/{info.get('category', 'all')}"
    return info

  def reset_async(
      self, requests: Sequence[tuple[int, int]]) -> concurrent.futures.Future[list[StepResult]]:
    """Starts one episode per (slot, run-wide task id) pair, each on its environment's pool
    (EnvPool.reset_async)."""
    try:
      split = [(slot, *self._split(task)) for slot, task in requests]
    except ValueError as error:
      return _failed(error)
    for slot, k, _ in split:
      self._playing[slot] = k
    return self._dispatch(split, EnvPool.reset_async)

  def step_async(
      self, requests: Sequence[tuple[int, str]]) -> concurrent.futures.Future[list[StepResult]]:
    """Applies one reply per (slot, reply) pair on the pool of the environment the slot last
    reset (EnvPool.step_async)."""
    unknown = [slot for slot, _ in requests if slot not in self._playing]
    if unknown:
      return _failed(ValueError(f"slot {unknown[0]!r} has no episode in progress; reset it first"))
    return self._dispatch([(slot, self._playing[slot], reply) for slot, reply in requests],
                          EnvPool.step_async)

  def close(self) -> None:
    """Closes every component's pool. Idempotent."""
    for component in self.components:
      component.pool.close()

  def __enter__(self) -> MixturePool:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _dispatch(self, requests: Sequence[tuple[int, int, Any]],
                call: _Batch) -> concurrent.futures.Future[list[StepResult]]:
    """`call(pool, [(slot, value), ...])` on each component's pool with its requests (slot,
    component, value), the results joined in request order."""
    parts: dict[int, tuple[list[int], list[tuple[int, Any]]]] = {}
    for position, (slot, k, value) in enumerate(requests):
      positions, calls = parts.setdefault(k, ([], []))
      positions.append(position)
      calls.append((slot, value))
    return _joined(len(requests), [(positions, call(self.components[k].pool, calls))
                                   for k, (positions, calls) in parts.items()])

  def _split(self, task: int) -> tuple[int, int]:
    """(component, its own task id) of a run-wide task id."""
    if not isinstance(task, int) or isinstance(task, bool) or task < 0:
      raise ValueError(f"task ids are non-negative ints, got {task!r}")
    k, own = divmod(task, STRIDE)
    if k >= len(self.components):
      raise ValueError(f"task {task} is of component {k}; the mixture has "
                       f"{len(self.components)}")
    return k, own


def _failed(error: Exception) -> concurrent.futures.Future:
  future: concurrent.futures.Future = concurrent.futures.Future()
  future.set_exception(error)
  return future


def _joined(
    count: int, parts: Sequence[tuple[Sequence[int], concurrent.futures.Future]]
) -> concurrent.futures.Future[list[Any]]:
  """One future of `count` results, made of `parts`: (positions, a future of their results);
  it fails as the first failing part, in part order."""
  joined: concurrent.futures.Future = concurrent.futures.Future()
  remaining, lock = [len(parts)], threading.Lock()

  def finish() -> None:
    results: list[Any] = [None] * count
    for positions, future in parts:
      if future.exception() is not None:
        joined.set_exception(future.exception())
        return
      for position, result in zip(positions, future.result()):
        results[position] = result
    joined.set_result(results)

  def part_done(_: concurrent.futures.Future) -> None:
    with lock:
      remaining[0] -= 1
      last = remaining[0] == 0
    if last:
      finish()

  if not parts:
    finish()
  for _, future in parts:
    future.add_done_callback(part_done)
  return joined
