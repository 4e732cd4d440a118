"""Rollouts played ahead of the learner: bounded-staleness asynchronous RL (rollout.max_staleness).

With max_staleness = k the episodes of step s are played by the policy after

  version(s) = max(0, s - k)

updates. The rollout side plays step s + k + 1 as soon as update s has made its policy, while the
learner trains steps s + 1 .. s + k on the rollouts already played: environment time and decoding
overlap the learner's work, and no step waits for its own rollout unless the rollout side falls
behind. The version is a function of the step, not of which policy the rollout side happened to
hold when it started, so a run does not depend on timing: the same seed gives the same run, on
any machine load, and k = 0 is the synchronous loop itself (each step plays its rollout with the
policy it then trains, in the caller's thread).

Partial rollouts (rollout.partial_rollouts, rollout.PolicySwitches): the rollout of step s starts
with version(s) and moves to newer versions as the learner makes them, up to version s itself,
at decode calls fixed in advance (waiting for a version not made yet), so a run still does not
depend on timing. The learner `publish`es each version; the rollout side reads it with
`policy`.

Stale rollouts are corrected in the loss by the sampler's log-probs (rl/correction.py: decoupled
PPO's behaviour-to-proximal weight, or its truncated or masked forms); they are never dropped.
Everything the rollout side touches (the sampler, the environment pool, the task cursor and
success estimates of the task draws) belongs to its one worker thread while the queue runs: an
evaluation runs there too (`run`), after the rollouts queued before it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class RolloutQueue(Generic[T]):
  """Step rollouts `play(step, params, version)`, each played by the policy of its version
  (module docstring), up to `max_staleness` updates ahead of the learner.

  `submit` queues a step with the parameters of a version, `take` returns its rollout (played
  by then, or waited for); with max_staleness 0 `take` plays it there and then. `snapshot`
  copies parameters that a later update would otherwise overwrite in place (a donated buffer)
  while the rollout side still reads them.
  """

  def __init__(self, play: Callable[[int, Any, int], T], max_staleness: int,
               snapshot: Callable[[Any], Any] = lambda params: params):
    if max_staleness < 0:
      raise ValueError(f"max_staleness={max_staleness} must be >= 0")
    self._play, self.max_staleness, self._snapshot = play, max_staleness, snapshot
    self._executor = (concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="rollout-queue") if max_staleness else None)
    self._queued: dict[int, concurrent.futures.Future[T] | tuple[Any, int]] = {}
    self._versions: dict[int, Any] = {}  # Published policies by version (partial rollouts).
    self._published = threading.Condition()
    self._closed = False

  def submit(self, step: int, params: Any, version: int) -> None:
    """Queues step `step`, played with `params`, the policy after `version` updates: the caller
    submits step s + k once update s has made version s + 1 (the module docstring's rule)."""
    if self._executor is None:
      self._queued[step] = (params, version)
      return
    with self._published:  # Partial rollouts' copy of that version, when there is one.
      snapshot = self._versions.get(version)
    if snapshot is None:
      snapshot = self._snapshot(params)
    self._queued[step] = self._executor.submit(self._play, step, snapshot, version)

  def publish(self, version: int, params: Any) -> None:
    """Makes the policy after `version` updates readable by partial rollouts (`policy`); the
    newest max_staleness + 1 versions are kept, the versions a rollout still in flight may
    move to."""
    with self._published:
      self._versions[version] = self._snapshot(params)
      for old in [v for v in self._versions if v < version - self.max_staleness]:
        del self._versions[old]
      self._published.notify_all()

  def policy(self, version: int) -> Any:
    """The policy after `version` updates, waiting until it is published; RuntimeError once the
    queue closes (the learner has stopped) or for a version no longer kept."""
    with self._published:
      self._published.wait_for(lambda: self._closed or version <= max(self._versions, default=-1))
      if version not in self._versions:
        raise RuntimeError(f"the policy of version {version} is not available to the rollout "
                           f"side ({'the run stopped' if self._closed else 'not kept'})")
      return self._versions[version]

  def put(self, step: int, played: T) -> None:
    """Queues the rollout of step `step` played before (a resumed run's buffer)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(played)
    self._queued[step] = future

  def take(self, step: int) -> T:
    """Step `step`'s rollout, out of the queue."""
    queued = self._queued.pop(step)
    if isinstance(queued, tuple):
      return self._play(step, *queued)
    return queued.result()

  def played(self) -> dict[int, T]:
    """Every queued rollout by step, each waited for and kept in the queue: what a checkpoint
    holds so that a resumed run trains on the same rollouts. Nothing with max_staleness 0."""
    if self._executor is None:
      return {}
    return {step: queued.result() for step, queued in sorted(self._queued.items())}

  def run(self, function: Callable[..., R], *args: Any) -> R:
    """`function(*args)` on the rollout side, after what is queued; waits for its result."""
    if self._executor is None:
      return function(*args)
    return self._executor.submit(function, *args).result()

  def close(self) -> None:
    """Stops the rollout side: queued steps not yet started are dropped, a running one
    finishes (a partial rollout waiting for a policy fails)."""
    with self._published:
      self._closed = True
      self._published.notify_all()
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)

  def __enter__(self) -> RolloutQueue[T]:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
