"""Slow environment steps on purpose: an adapter whose every step first sleeps a drawn time.

Simulators (SciWorld's JVM), browsers (WebArena) and environments behind HTTP take a variable,
heavy-tailed time a step. `Latency` adds such a time to any adapter, so that the rollout's
overlap machinery (pipelined groups, continuous batching, asynchronous RL) can be measured on a
fast environment: each step sleeps a log-normal time of mean `mean_s` and log-space spread
`sigma`, capped at `max_s` (mean 0.3 s with sigma 0.9 puts the 99.9th percentile near 3 s).

The draws are a function of (seed, the adapter's episode count, task id, turn), not of the
clock or the thread that runs the step, so runs compared side by side sleep the same times.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from environments import base
from environments.base import StepResult


@dataclasses.dataclass(frozen=True)
class StepLatency:
  """A step's added time: log-normal with mean `mean_s` and log-space standard deviation
  `sigma`, capped at `max_s` seconds."""

  mean_s: float
  sigma: float = 0.9
  max_s: float = 3.0
  seed: int = 0

  def __post_init__(self):
    if not (self.mean_s > 0 and self.sigma >= 0 and self.max_s >= self.mean_s):
      raise ValueError(f"a step latency of mean {self.mean_s} s, sigma {self.sigma} and cap "
                       f"{self.max_s} s needs mean > 0, sigma >= 0 and cap >= mean")

  def seconds(self, episode: int, task_id: int, turn: int) -> float:
    """The sleep of `turn` in the adapter's `episode`-th episode, of task `task_id`."""
    rng = np.random.default_rng([self.seed, episode, task_id, turn])
    # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2) = mean_s.
    mu = math.log(self.mean_s) - self.sigma**2 / 2
    return min(float(rng.lognormal(mu, self.sigma)), self.max_s)


class Latency:
  """`env` (an adapter) whose steps each sleep `latency.seconds(...)` first."""

  def __init__(self, env: base.Env, latency: StepLatency):
    self.env, self.latency = env, latency
    self.name = env.name
    self._episode, self._task_id, self._turn = -1, -1, 0

  def __getattr__(self, name: str) -> Any:
    # The adapter's optional attributes (action_format, tools) read through.
    return getattr(self.env, name)

  @property
  def instruction(self) -> str:
    return self.env.instruction

  def task_ids(self, split: str) -> Sequence[int]:
    return self.env.task_ids(split)

  def task_info(self, task_id: int) -> dict[str, Any]:
    return self.env.task_info(task_id)

  def reset(self, task_id: int) -> str:
    self._episode, self._task_id, self._turn = self._episode + 1, task_id, 0
    return self.env.reset(task_id)

  def step(self, action_text: str) -> StepResult:
    time.sleep(self.latency.seconds(self._episode, self._task_id, self._turn))
    self._turn += 1
    return self.env.step(action_text)

  def close(self) -> None:
    self.env.close()


def slowed(factory: Callable[[], base.Env], latency: StepLatency) -> Latency:
  """The adapter `factory()` makes, its steps slowed by `latency` (EnvPool's `latency`; a
  functools.partial of it pickles for the process backend when `factory` does)."""
  return Latency(factory(), latency)
