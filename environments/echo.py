"""Echo: a tiny multi-turn environment for learning tests and quick ablations.

Each episode is a hidden sequence of `turns` symbols drawn (per task id) from `symbols`. Every
observation shows the next symbol; the agent must answer with it. The first symbol character in
the reply is the answer; a wrong or missing answer ends the episode with reward 0, and answering
every turn correctly gives reward 1. A randomly initialised policy succeeds now and then, and
solving it needs reading the latest observation, so it exercises the whole multi-turn path
(live KV cache, loss mask on replies only, horizon caps) in seconds on a CPU. `step_delay_s`
makes every step wait that long (outside the GIL), standing in for a slow simulator or a remote
environment in benchmarks.
"""

from __future__ import annotations

import random
import time
from typing import Any, Sequence

from environments.base import StepResult, check_split


class EchoEnv:
  """Repeat the symbol you are shown, `turns` times in a row."""

  name = "echo"

  def __init__(self, turns: int = 2, symbols: str = "01", num_train: int = 1000,
               num_test: int = 100, step_delay_s: float = 0.0):
    if turns < 1:
      raise ValueError(f"turns must be >= 1, got {turns}")
    if step_delay_s < 0:
      raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s}")
    if len(set(symbols)) != len(symbols) or not symbols:
      raise ValueError(f"symbols must be distinct characters, got {symbols!r}")
    self.turns = turns
    self.symbols = symbols
    self.step_delay_s = step_delay_s
    self._splits = {"test": range(num_test), "train": range(num_test, num_test + num_train)}
    self._sequence: str = ""
    self._turn = 0

  @property
  def instruction(self) -> str:
    return f"Repeat each symbol you are shown. Symbols: {' '.join(self.symbols)}."

  def task_ids(self, split: str) -> Sequence[int]:
    return self._splits[check_split(split)]

  def task_info(self, task_id: int) -> dict[str, Any]:
    return {"category": "echo", "sequence": self._draw(task_id)}

  def _draw(self, task_id: int) -> str:
    rng = random.Random(task_id)
    return "".join(rng.choice(self.symbols) for _ in range(self.turns))

  def reset(self, task_id: int) -> str:
    self._sequence = self._draw(task_id)
    self._turn = 0
    return self._sequence[0]

  def step(self, action_text: str) -> StepResult:
    if not self._sequence or self._turn >= self.turns:
      raise RuntimeError("step() called outside an episode; call reset() first")
    time.sleep(self.step_delay_s)
    answer = next((c for c in action_text if c in self.symbols), None)
    if answer != self._sequence[self._turn]:
      self._turn = self.turns
      return StepResult("Wrong.", 0.0, True, {"success": False})
    self._turn += 1
    if self._turn == self.turns:
      return StepResult("Correct. Done.", 1.0, True, {"success": True})
    return StepResult(self._sequence[self._turn], 0.0, False, {"success": False})

  def close(self) -> None:
    self._sequence = ""
