"""A tiny deterministic guessing game implementing the `Env` protocol, for pool and HTTP tests.

Task `t` hides the digit `secret(t) = (7 t + 3) mod 10`; the agent replies "Action: guess N" and
is told "too low", "too high" or "correct" (reward 1, done); after `max_guesses` wrong guesses
the episode ends with reward 0. Replies can also make the adapter misbehave on purpose:
"Action: crash" raises, "Action: hang" sleeps `hang_s` seconds. Every step first sleeps
`sleep_s` seconds and every reset `reset_sleep_s` seconds, so tests can make calls slow. With
`helper=True` the adapter starts a helper process (as SciWorld starts a JVM), whose pid
`task_info` reports.
"""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any, Sequence

from environments import base
from environments.base import StepResult

TRAIN_IDS = tuple(range(20))
TEST_IDS = tuple(range(100, 110))


def secret(task_id: int) -> int:
  return (7 * task_id + 3) % 10


class ToyEnv:
  """The guessing game. Class-level counters record how many adapters were built and closed."""

  name = "toy"
  created = 0
  closed = 0
  _count_lock = threading.Lock()

  def __init__(self, max_guesses: int = 5, sleep_s: float = 0.0, hang_s: float = 30.0,
               reset_sleep_s: float = 0.0, helper: bool = False):
    self.max_guesses = max_guesses
    self.sleep_s = sleep_s
    self.reset_sleep_s = reset_sleep_s
    self.hang_s = hang_s
    self._helper = subprocess.Popen(["sleep", "300"]) if helper else None
    self._task_id: int | None = None
    self._guesses = 0
    self._done = True
    self._closed = False
    with ToyEnv._count_lock:
      ToyEnv.created += 1

  @property
  def instruction(self) -> str:
    return ("Guess the secret digit. Reply as \"Thought: ...\\n\\nAction: guess N\" "
            "with N in 0-9.")

  def task_ids(self, split: str) -> Sequence[int]:
    return {"train": TRAIN_IDS, "test": TEST_IDS}[base.check_split(split)]

  def task_info(self, task_id: int) -> dict[str, Any]:
    self._check_task(task_id)
    info: dict[str, Any] = {"category": "even" if secret(task_id) % 2 == 0 else "odd"}
    if self._helper is not None:
      info["helper_pid"] = self._helper.pid
    return info

  def reset(self, task_id: int) -> str:
    self._check_task(task_id)
    time.sleep(self.reset_sleep_s)
    self._task_id, self._guesses, self._done = task_id, 0, False
    return f"Task {task_id}: guess the secret digit in at most {self.max_guesses} guesses."

  def step(self, action_text: str) -> StepResult:
    if self._done:
      raise RuntimeError("step() without an episode in progress")
    time.sleep(self.sleep_s)
    action = action_text.rpartition("Action:")[2].strip()
    if action == "crash":
      raise RuntimeError("the toy env crashed on purpose")
    if action == "hang":
      time.sleep(self.hang_s)
      return StepResult("Woke up.", 0.0, False, {})
    verb, _, number = action.partition(" ")
    if verb != "guess" or not number.isdigit():
      return StepResult(f"Unknown action {action!r}; use \"guess N\".", 0.0, False,
                        {"invalid_action": True})
    self._guesses += 1
    guess, target = int(number), secret(self._task_id)
    if guess == target:
      self._done = True
      return StepResult(f"Guess {self._guesses}: {guess} is correct.", 1.0, True, {"success": True})
    hint = "too low" if guess < target else "too high"
    observation = f"Guess {self._guesses}: {guess} is {hint}."
    if self._guesses == self.max_guesses:
      self._done = True
      return StepResult(observation + " Out of guesses.", 0.0, True, {"success": False})
    return StepResult(observation, 0.0, False, {})

  def close(self) -> None:
    if not self._closed:
      self._closed = True
      if self._helper is not None:
        self._helper.kill()
        self._helper.wait()
      with ToyEnv._count_lock:
        ToyEnv.closed += 1

  def _check_task(self, task_id: int) -> None:
    if task_id not in TRAIN_IDS and task_id not in TEST_IDS:
      raise ValueError(f"unknown toy task {task_id}")


def register() -> None:
  """Registers the game as environment "toy"."""
  base.register("toy", ToyEnv)
