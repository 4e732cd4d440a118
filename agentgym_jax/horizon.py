"""Interaction-horizon schedules: the cap on agent-environment turns at each training step.

ScalingInter-RL (AgentGym-RL, Xi et al. 2025) trains with a short turn cap first (exploitation,
stable updates) and raises it in stages (exploration, longer strategies):

  fixed     h_t = h                                        the non-staged baseline
  stepwise  h_t = caps[min(t // every, len(caps) - 1)]     the paper's scripts, e.g. TextCraft
                                                           caps [10, 20, 30] every 100 steps
  linear    h_t = min(initial + (t // every) * increment, maximum)
                                                           the paper's h_{k+1} = h_k + delta_h

Schedules are frozen dataclasses and pure functions of the step, so a resumed run recovers its
stage from the checkpointed step alone. `max_turns` is the largest cap the schedule can reach,
for sizing static rollout buffers once.

Configs (dicts or ml_collections.ConfigDict) name the kind and its fields:

  {"kind": "fixed", "turns": 30}
  {"kind": "stepwise", "caps": [10, 20, 30], "every": 100}
  {"kind": "linear", "initial": 10, "increment": 5, "every": 100, "maximum": 30}
"""

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any


def _check_positive_int(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"Horizon schedule field `{name}` must be a positive integer, got {value!r}.")


def _check_step(step: int) -> int:
  try:
    step = operator.index(step)
  except TypeError:
    raise TypeError(f"Training step must be an integer, got {step!r}.") from None
  if step < 0:
    raise ValueError(f"Training step must be >= 0, got {step}.")
  return step


@dataclasses.dataclass(frozen=True)
class FixedHorizon:
  """The same turn cap at every step."""

  turns: int

  def __post_init__(self):
    _check_positive_int("turns", self.turns)

  @property
  def max_turns(self) -> int:
    return self.turns

  def stage(self, step: int) -> int:
    _check_step(step)
    return 0

  def cap(self, step: int) -> int:
    _check_step(step)
    return self.turns


@dataclasses.dataclass(frozen=True)
class StepwiseHorizon:
  """caps[k] during stage k = step // every, holding the last cap once the list runs out."""

  caps: tuple[int, ...]
  every: int

  def __post_init__(self):
    if isinstance(self.caps, (str, bytes)) or not isinstance(self.caps, (list, tuple)):
      raise ValueError(
          f"Horizon schedule field `caps` must be a list of integers, got {self.caps!r}.")
    object.__setattr__(self, "caps", tuple(self.caps))
    if not self.caps:
      raise ValueError("Horizon schedule field `caps` must not be empty.")
    for cap in self.caps:
      _check_positive_int("caps", cap)
    if any(later <= earlier for earlier, later in zip(self.caps, self.caps[1:])):
      raise ValueError(
          f"Horizon schedule `caps` must be strictly increasing, got {list(self.caps)}.")
    _check_positive_int("every", self.every)

  @property
  def max_turns(self) -> int:
    return self.caps[-1]

  def stage(self, step: int) -> int:
    return min(_check_step(step) // self.every, len(self.caps) - 1)

  def cap(self, step: int) -> int:
    return self.caps[self.stage(step)]


@dataclasses.dataclass(frozen=True)
class LinearHorizon:
  """initial + stage * increment turns, stage = step // every, saturating at `maximum`.

  The stage stops counting once the cap reaches `maximum`, so stages and caps stay one-to-one.
  """

  initial: int
  increment: int
  every: int
  maximum: int

  def __post_init__(self):
    for field in dataclasses.fields(self):
      _check_positive_int(field.name, getattr(self, field.name))
    if self.maximum < self.initial:
      raise ValueError(
          f"Horizon schedule `maximum` ({self.maximum}) must be >= `initial` ({self.initial}).")

  @property
  def max_turns(self) -> int:
    return self.maximum

  @property
  def num_stages(self) -> int:
    # Increments needed to reach the maximum (the last one may overshoot and be capped), + 1.
    return -(-(self.maximum - self.initial) // self.increment) + 1

  def stage(self, step: int) -> int:
    return min(_check_step(step) // self.every, self.num_stages - 1)

  def cap(self, step: int) -> int:
    return min(self.initial + self.stage(step) * self.increment, self.maximum)


HorizonSchedule = FixedHorizon | StepwiseHorizon | LinearHorizon

HORIZON_SCHEDULES: dict[str, type[HorizonSchedule]] = {
    "fixed": FixedHorizon,
    "stepwise": StepwiseHorizon,
    "linear": LinearHorizon,
}


def make_horizon_schedule(config: Mapping[str, Any]) -> HorizonSchedule:
  """Builds a schedule from {"kind": ..., <fields of that kind>}; see the module docstring.

  Raises:
    ValueError: unknown kind, missing or unknown fields, or invalid values, with a message
      naming what is expected.
  """
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict
    config = config.to_dict()
  if not isinstance(config, Mapping):
    raise ValueError(f"Horizon schedule config must be a mapping, got {type(config).__name__}.")
  fields = dict(config)
  kind = fields.pop("kind", None)
  if kind not in HORIZON_SCHEDULES:
    raise ValueError(f"Unknown horizon schedule kind {kind!r}; expected one of: "
                     f"{', '.join(repr(name) for name in HORIZON_SCHEDULES)}.")
  schedule_class = HORIZON_SCHEDULES[kind]
  expected = [field.name for field in dataclasses.fields(schedule_class)]
  missing = [name for name in expected if name not in fields]
  unknown = sorted(set(fields) - set(expected))
  if missing or unknown:
    raise ValueError(f"Horizon schedule {kind!r} takes fields {expected}; "
                     f"missing {missing}, unknown {unknown}.")
  return schedule_class(**fields)
