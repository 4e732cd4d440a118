"""BabyAIEnv: the text adapter over minigrid's BabyAI levels.

Observation: the goal (first turn only), the visible objects with their positions in steps,
what blocks the way ahead, what is carried, and "Available actions: [...]". A high-level action
expands to minigrid primitives (see actions.py); they run until the list ends or the level
ends. Reward is minigrid's, summed over those primitives:

  r = 1 - 0.9 * step_count / max_steps   on success (step_count counts primitive steps),
  r = 0                                  otherwise,

so shorter solutions score higher. The episode is done on success, on a level's failure
condition, or when minigrid truncates at max_steps. Invalid actions (and, in the tool_call
format, tool calls that cannot be carried out) run no primitive and cost no reward; they return
an error message and the available actions.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
from typing import Any, Iterator

import gymnasium
import minigrid  # noqa: F401  (registers the BabyAI levels with gymnasium)
from minigrid.minigrid_env import MiniGridEnv

from environments import base
from environments.babyai import actions as actions_lib
from environments.babyai import levels
from environments.babyai import scene as scene_lib

INSTRUCTION = """\
You are an agent in a BabyAI grid world: rooms separated by walls and doors, with balls, boxes \
and keys in six colors. Your goal is given in the first observation. Each observation lists \
the objects you can see, named "<color> <object> <k>" where k tells objects of the same color \
and kind apart (1 is the nearest), with how many steps forward and to the left or right each \
one is. It also says what blocks your way ahead, what you are carrying, and which actions you \
can take now.

Actions:
- turn left / turn right: turn 90 degrees where you stand.
- move forward: step one cell forward.
- go to <color> <object> <k>: walk next to the object (or door) and face it.
- pick up <color> <object> <k>: walk to the object and pick it up. You can carry one object at \
a time; "pick up" alone picks up the object right in front of you.
- drop: put what you carry on the empty cell in front of you.
- toggle: open or close the door in front of you, or open the box in front of you. A locked \
door opens only while you carry a key of its color.
- go through <color> door <k>: walk through an open door into the next room.
- toggle and go through <color> door <k>: open a closed or locked door and walk through it.
- check available actions: look again and list the actions you can take.
Walking uses only the cells you can currently see: to reach something out of sight, turn or \
move to see it first. Fewer steps earn a higher reward.

{reply_format}"""

_OBJECT = '"<color> <object> <k>" as the observation names it, e.g. "red ball 1"'
_DOOR = 'the door as the observation names it, e.g. "blue door 1"'
TOOLS = (base.Tool("turn_left", "Turn 90 degrees left where you stand.", "turn left"),
         base.Tool("turn_right", "Turn 90 degrees right where you stand.",
                   "turn right"), base.Tool("move_forward", "Step one cell forward.",
                                            "move forward"),
         base.Tool("go_to", "Walk next to an object or door and face it.", "go to {object}",
                   (base.Parameter("object", "string", f"The object or door: {_OBJECT}."),)),
         base.Tool(
             "pick_up", "Walk to an object and pick it up (one at a time); without an "
             "object, pick up the object right in front of you.", "pick up {object}",
             (base.Parameter("object", "string", f"The object: {_OBJECT}.", required=False),)),
         base.Tool("drop", "Put what you carry on the empty cell in front of you.", "drop"),
         base.Tool(
             "toggle", "Open or close the door in front of you, or open the box in front of "
             "you. A locked door opens only while you carry a key of its color.", "toggle"),
         base.Tool("go_through", "Walk through an open door into the next room.",
                   "go through {door}", (base.Parameter("door", "string", f"The door: {_DOOR}."),)),
         base.Tool("toggle_and_go_through", "Open a closed or locked door and walk through it.",
                   "toggle and go through {door}",
                   (base.Parameter("door", "string", f"The door: {_DOOR}."),)),
         base.Tool("check_available_actions", "Look again and list the actions you can take now.",
                   "check available actions"))

# minigrid prints "Sampling rejected: ..." while it generates a level (in reset, never in
# step). The lock keeps two threads from interleaving redirects, where each would restore the
# stream the other replaced.
_QUIET_LOCK = threading.Lock()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  with _QUIET_LOCK, contextlib.redirect_stdout(io.StringIO()):
    yield


def _available(scene: scene_lib.Scene) -> str:
  return "Available actions: " + json.dumps(actions_lib.available(scene))


class BabyAIEnv:
  """One BabyAI episode at a time; see the module docstring for observations and rewards."""

  name = "babyai"

  def __init__(self, train_size: int = 4000, action_format: str = "react"):
    """train_size: train task ids; action_format: react or tool_call (environments/base.py;
    the tools are TOOLS)."""
    if isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 1:
      raise ValueError(f"train_size must be a positive int, got {train_size!r}")
    self._train_size = train_size
    self.action_format = base.ActionFormat(action_format, TOOLS)
    self._levels: dict[str, MiniGridEnv] = {}  # one generator per level, re-seeded per reset
    self._env: MiniGridEnv | None = None
    self._scene: scene_lib.Scene | None = None  # the view after the last reset/step
    self._done = True

  @property
  def instruction(self) -> str:
    return INSTRUCTION.format(reply_format=self.action_format.reply_format())

  @property
  def minigrid_env(self) -> MiniGridEnv:
    """The running minigrid level, to read (e.g. for an expert); only `step` may advance it."""
    if self._env is None:
      raise RuntimeError("no episode: call reset(task_id) first")
    return self._env

  def task_ids(self, split: str) -> range:
    return levels.task_ids(split, self._train_size)

  def task_info(self, task_id: int) -> dict[str, Any]:
    return levels.task_info(task_id)

  def reset(self, task_id: int) -> str:
    info = levels.task_info(task_id)
    with _quiet():
      env = self._levels.get(info["level"])
      if env is None:
        env = gymnasium.make(info["level"], disable_env_checker=True).unwrapped
        self._levels[info["level"]] = env
      env.reset(seed=info["seed"])
    self._env, self._done = env, False
    scene = self._scene = scene_lib.observe(env)
    return f"Your goal: {env.mission}\n{scene.describe()}\n{_available(scene)}"

  def step(self, action_text: str) -> base.StepResult:
    env = self.minigrid_env
    if self._done:
      raise RuntimeError("the episode is over: call reset(task_id) for a new one")
    scene = self._scene
    try:
      primitives = actions_lib.expand(_parse(self.action_format.react_reply(action_text)), scene)
    except (actions_lib.ActionError, base.ToolCallError) as error:
      return base.StepResult(f"{error}\n{_available(scene)}", 0.0, False,
                             self._info(success=False, valid_action=False))
    reward, terminated, truncated = 0.0, False, False
    for primitive in primitives:
      _, primitive_reward, terminated, truncated, _ = env.step(primitive)
      reward += float(primitive_reward)
      if terminated or truncated:
        break
    success = terminated and reward > 0
    self._done = terminated or truncated
    scene = self._scene = scene_lib.observe(env)
    if success:
      ending = "The task is completed."
    elif terminated:
      ending = "The task has failed: that action broke the goal's conditions."
    elif truncated:
      ending = "You ran out of steps; the episode is over."
    else:
      ending = _available(scene)
    return base.StepResult(f"{scene.describe()}\n{ending}", reward, self._done,
                           self._info(success=success, valid_action=True))

  def close(self) -> None:
    for env in self._levels.values():
      env.close()
    self._levels.clear()
    self._env, self._scene, self._done = None, None, True

  def _info(self, success: bool, valid_action: bool) -> dict[str, Any]:
    return {
        "success": success, "valid_action": valid_action,
        "primitive_steps": self.minigrid_env.step_count
    }


def _parse(reply: str) -> actions_lib.Command:
  """The Command in a model reply; ActionError with a format hint if there is none."""
  text = actions_lib.extract_action(reply)
  command = actions_lib.parse(text)
  if command is not None:
    return command
  if not actions_lib.has_action_mark(reply):
    raise actions_lib.ActionError(
        'Your reply has no "Action:" line. Write "Thought: <reasoning>", a blank line, then '
        '"Action: <one action>" with one of the available actions.')
  shown = text if len(text) <= 80 else text[:77] + "..."
  raise actions_lib.ActionError(f'"{shown}" is not a valid action. Choose one of the '
                                "available actions.")
