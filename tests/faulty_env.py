"""Echo with injected faults, keyed by task id, for reliability tests of the train loop.

Train task `t` (ids 100..100+num_train-1) misbehaves on its first step when `t - 100` is in:
  raise_tasks  step() raises RuntimeError (the pool ends the episode as "env_error");
  hang_tasks   step() sleeps `hang_s` seconds first (past env.step_timeout: "env_timeout");
and with `nan_reward=True` every step of every task returns reward NaN. Other tasks play the
echo game unchanged. Faults keyed by task id make them deterministic under any policy: every
episode reaches at least one step, and every sample of a faulty task fails.
"""

from __future__ import annotations

import time
from typing import Sequence

from environments import base
from environments.base import StepResult
from environments.echo import EchoEnv

NAME = "faulty_echo"
FIRST_TRAIN_ID = 100  # EchoEnv's train ids start after its num_test=100 test ids.


class FaultyEchoEnv(EchoEnv):
  """EchoEnv whose steps raise, hang or return NaN rewards on chosen tasks."""

  name = NAME

  def __init__(self, turns: int = 2, num_train: int = 4, raise_tasks: Sequence[int] = (),
               hang_tasks: Sequence[int] = (), hang_s: float = 2.0, nan_reward: bool = False):
    super().__init__(turns=turns, num_train=num_train)
    self.raise_tasks = frozenset(raise_tasks)
    self.hang_tasks = frozenset(hang_tasks)
    self.hang_s = hang_s
    self.nan_reward = nan_reward
    self._task_id = -1

  def reset(self, task_id: int) -> str:
    self._task_id = task_id
    return super().reset(task_id)

  def step(self, action_text: str) -> StepResult:
    index = self._task_id - FIRST_TRAIN_ID
    if index in self.raise_tasks:
      raise RuntimeError(f"injected fault in task {self._task_id}")
    if index in self.hang_tasks:
      time.sleep(self.hang_s)
    result = super().step(action_text)
    if self.nan_reward:
      return StepResult(result.observation, float("nan"), result.done, result.info)
    return result


def register() -> None:
  base.register(NAME, FaultyEchoEnv)
