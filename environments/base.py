"""The environment adapter protocol and the registry of adapters.

An adapter wraps one episode at a time of one environment. The rollout talks to adapters only
through this protocol (usually via `environments.pool.EnvPool`), so a new environment plugs in
by implementing five methods and registering a name; the training code never changes.

Conversation contract (what the rollout renders):
  user:      adapter.instruction + "\n\n" + reset(task_id)
  assistant: "Thought: ...\n\nAction: ..."
  user:      step(reply).observation
  ...
Rewards are per step; the episode's outcome reward is their sum. `info["success"]` says whether
the task was solved (for SciWorld success means score 100, while the reward is the score / 100).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

SPLITS = ("train", "test")


def react_reply(thought: str, action: str) -> str:
  """A reply in the format every environment's instruction asks for (ReAct)."""
  return f"Thought: {thought}\n\nAction: {action}"


class ExpertError(RuntimeError):
  """An environment's expert could not produce replies for a task."""

# Why an episode ended: its own end, the rollout's turn cap or context limit, or a failure of
# its environment (an exception, or a step slower than the pool's timeout).
DONE, HORIZON, CONTEXT, ENV_ERROR, ENV_TIMEOUT = (
    "done", "horizon", "context", "env_error", "env_timeout")


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one env step returns: the next observation and the step's reward."""

  observation: str
  reward: float
  done: bool
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
  """One episode at a time of one environment.

  Task ids are non-negative ints, stable across machines, processes and PYTHONHASHSEED, and
  disjoint between splits. They are the `data_idx` of the AgentGym HTTP protocol.
  """

  name: str

  @property
  def instruction(self) -> str:
    """The environment's rules and reply format, shown before the first observation."""

  def task_ids(self, split: str) -> Sequence[int]:
    """All task ids of `split` (one of SPLITS), in a fixed order."""

  def task_info(self, task_id: int) -> dict[str, Any]:
    """Metadata of a task; has a "category" key used to break down evaluation."""

  def reset(self, task_id: int) -> str:
    """Starts an episode of task `task_id`; returns the first observation."""

  def step(self, action_text: str) -> StepResult:
    """Applies the model's whole reply (the adapter parses the action out of it)."""

  def close(self) -> None:
    """Releases processes, sockets and files. Idempotent."""


class EnvError(RuntimeError):
  """An environment failed (not the agent): ends that episode, never the batch."""


def check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  return split


# name -> "module:attribute" of a factory `(**options) -> Env`. Modules are imported on first
# use so that heavy dependencies (a JVM, minigrid) load only for the environments a run makes.
_REGISTRY: dict[str, str | Callable[..., Env]] = {
    "textcraft": "environments.textcraft:TextCraftEnv",
    "babyai": "environments.babyai:BabyAIEnv",
    "sciworld": "environments.sciworld:SciWorldEnv",
    "searchqa": "environments.searchqa:SearchQAEnv",
    "webarena": "environments.webarena:WebArenaEnv",
    "webarena_remote": "environments.webarena:AgentGymWebArenaClient",
    "echo": "environments.echo:EchoEnv",
    "http": "environments.http.client:AgentGymClient",
}


def register(name: str, factory: str | Callable[..., Env]) -> None:
  """Registers `factory` (a callable or a "module:attribute" path) under `name`."""
  _REGISTRY[name] = factory


def registered() -> list[str]:
  return sorted(_REGISTRY)


def make(name: str, **options: Any) -> Env:
  """Builds a fresh adapter of the environment registered as `name`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; registered: {', '.join(registered())}")
  factory = _REGISTRY[name]
  if isinstance(factory, str):
    module_name, attribute = factory.split(":")
    factory = getattr(importlib.import_module(module_name), attribute)
  return factory(**options)
