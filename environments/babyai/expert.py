"""BabyAI's expert: minigrid's BabyAIBot plays the level primitive by primitive; its trace is then
shortened into our high-level actions ("pick up red ball 1") wherever one reaches a later state
of the trace in no more primitive steps, so demonstrations fit the paper's 6-20 turn horizons.
The thoughts say the bot's subgoals. Replies are in the env's action format (ReAct, or the tool
calls of BabyAI's TOOLS).
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Mapping, Sequence

from environments import base

# minigrid's primitive actions (minigrid.core.actions.Actions) and our text actions for them.
_LEFT, _RIGHT, _FORWARD, _PICKUP, _DROP, _TOGGLE = range(6)
_PRIMITIVE_TEXT = {
    _LEFT: "turn left", _RIGHT: "turn right", _FORWARD: "move forward", _PICKUP: "pick up",
    _DROP: "drop", _TOGGLE: "toggle"
}
_HIGH_LEVEL_VERBS = ("go to", "pick up", "go through", "toggle and go through")
# Headings as minigrid's agent_dir: 0 = +x, 1 = +y, 2 = -x, 3 = -y.
_DIRECTION = ((1, 0), (0, 1), (-1, 0), (0, -1))


def replies(env: base.Env, task_id: int, *, max_primitives: int = 1000,
            high_level: bool = True) -> list[str]:
  """BabyAIBot's solution of a BabyAI task as replies (see the module docstring).

  Args:
    env: a BabyAIEnv (the bot reads its `minigrid_env`).
    task_id: the task.
    max_primitives: the bot gives up after this many primitive steps.
    high_level: shorten the bot's primitive trace into high-level actions where they reach the
      same state (position, heading, grid, carried object and mission progress) in no more
      steps; a trace that cannot be shortened that way keeps its primitive actions.
  """
  from minigrid.utils.baby_ai_bot import BabyAIBot  # pylint: disable=import-outside-toplevel
  env.reset(task_id)
  level = env.minigrid_env
  mission = level.mission
  bot = BabyAIBot(level)
  primitives: list[int] = []
  thoughts: list[str] = []
  states = [_babyai_state(level)]
  result = None
  while result is None or not result.done:
    if len(primitives) == max_primitives:
      raise base.ExpertError(f"the bot did not finish within {max_primitives} primitive steps")
    try:
      primitive = bot.replan()
    except Exception as error:  # The bot asserts when it cannot solve a level (KeyInBox).
      raise base.ExpertError(f"BabyAIBot failed: {error!r}") from error
    if int(primitive) not in _PRIMITIVE_TEXT:
      raise base.ExpertError(f"the bot chose {primitive!r} with the task not done")
    thoughts.append(_bot_thought(bot, level))
    result = env.step(base.reply_for(env, thoughts[-1], _PRIMITIVE_TEXT[int(primitive)]))
    if not result.info.get("valid_action", True):
      raise base.ExpertError(f"the env refused the bot's {_PRIMITIVE_TEXT[int(primitive)]!r}: "
                             f"{result.observation.splitlines()[0]}")
    primitives.append(int(primitive))
    states.append(_babyai_state(level))
  turns = [(t, _PRIMITIVE_TEXT[p]) for t, p in zip(thoughts, primitives)]
  if high_level:
    turns = _shorten(env, task_id, primitives, thoughts, states) or turns
  (thought, action), *rest = turns
  turns = [(f"My mission is to {mission}. {thought}", action), *rest]
  return [base.reply_for(env, thought, action) for thought, action in turns]


def _shorten(env: base.Env, task_id: int, primitives: Sequence[int], thoughts: Sequence[str],
             states: Sequence[tuple]) -> list[tuple[str, str]] | None:
  """The bot's trace as (thought, action) turns in high-level actions where possible; None if a
  step does not reproduce.

  From trace state i, every available high-level action is tried on a copy of the level; one
  that reaches trace state j > i + 1 in at most j - i primitives (or ends the episode in
  success) replaces primitives[i:j]; the one reaching furthest wins, ties going to fewer
  primitives and then to the order of the available-actions list.
  """
  from environments.babyai import actions as actions_lib  # pylint: disable=import-outside-toplevel
  from environments.babyai import scene as scene_lib  # pylint: disable=import-outside-toplevel
  end = len(primitives)
  later = collections.defaultdict(list)  # state -> trace indices where it occurs
  for index, state in enumerate(states):
    later[state].append(index)
  places = {(s[0], s[1]) for s in states}
  env.reset(task_id)
  turns, i = [], 0
  while i < end:
    level = env.minigrid_env
    scene = scene_lib.observe(level)
    best: tuple[int, int, str] | None = None  # (reached index, -primitives, action)
    for action in actions_lib.available(scene):
      if not action.startswith(_HIGH_LEVEL_VERBS) or action == "pick up":
        continue
      steps = actions_lib.expand(actions_lib.parse(action), scene)
      if _final_place(level, steps) not in places:
        continue  # cheap filter: it ends somewhere the bot never stood
      reached = _reached(level, steps, later, i, success_index=end + 1)
      if reached is not None and reached > i + 1 and (best is None or
                                                      (reached, -len(steps)) > best[:2]):
        best = (reached, -len(steps), action)
    if best is None:
      j, action = i + 1, _PRIMITIVE_TEXT[primitives[i]]
    else:
      j, _, action = best
    thought = " ".join(dict.fromkeys(thoughts[i:j]))  # distinct subgoals, in order
    result = env.step(base.reply_for(env, thought, action))
    turns.append((thought, action))
    if result.done:
      return turns if result.info.get("success") else None
    if j > end or _babyai_state(env.minigrid_env) != states[j]:
      return None
    i = j
  return None


def _final_place(level, steps: Sequence[int]) -> tuple[tuple[int, int], int]:
  """Where (position, heading) `steps` leave the agent, if every forward step succeeds."""
  (x, y), heading = tuple(int(v) for v in level.agent_pos), int(level.agent_dir)
  for step in steps:
    if step == _LEFT:
      heading = (heading - 1) % 4
    elif step == _RIGHT:
      heading = (heading + 1) % 4
    elif step == _FORWARD:
      x, y = x + _DIRECTION[heading][0], y + _DIRECTION[heading][1]
  return (x, y), heading


def _reached(level, steps: Sequence[int], later: Mapping[tuple, list[int]], start: int, *,
             success_index: int) -> int | None:
  """The furthest trace index after `start` whose state `steps` reach from the level's state
  in at most as many primitives; `success_index` if they end the episode in success."""
  trial = copy.deepcopy(level)
  reward, terminated, truncated = 0.0, False, False
  for step in steps:
    _, reward, terminated, truncated, _ = trial.step(step)
    if terminated or truncated:
      break
  if terminated and reward > 0:
    return success_index
  if terminated or truncated:
    return None
  candidates = [j for j in later.get(_babyai_state(trial), ()) if j - start >= len(steps)]
  return max(candidates, default=None)


def _babyai_state(level) -> tuple:
  """What the rest of an episode depends on: the agent, the grid, the carried object and the
  mission's progress (minigrid's step count only changes the reward)."""
  carrying = level.carrying
  return ((int(level.agent_pos[0]), int(level.agent_pos[1])),
          int(level.agent_dir), None if carrying is None else (carrying.type, carrying.color),
          level.grid.encode().tobytes(), _mission_progress(level.instrs))


def _mission_progress(instr) -> Any:
  if hasattr(instr, "instr_a"):  # before / after / and: two sub-instructions
    return (instr.a_done, instr.b_done, _mission_progress(instr.instr_a),
            _mission_progress(instr.instr_b))
  return getattr(instr, "lastStepMatch", None)


def _bot_thought(bot, level) -> str:
  """The bot's current subgoal (top of its stack after replanning), as a sentence."""
  if not bot.stack:
    return "The mission is nearly done."
  subgoal = bot.stack[-1]
  kind = type(subgoal).__name__
  if kind == "GoNextToSubgoal":
    if subgoal.reason == "Explore":
      return "I have not seen everything I need yet, so I explore."
    target = _describe(subgoal.datum, level)
    return f"I go next to {target}." if target else "I move out of the way."
  if kind == "ExploreSubgoal":
    return "I have not seen everything I need yet, so I explore."
  if kind == "OpenSubgoal":
    return "I open the door in front of me."
  if kind == "CloseSubgoal":
    return "I close the door in front of me."
  if kind == "PickupSubgoal":
    front = level.grid.get(*level.front_pos)
    return f"I pick up the {front.color} {front.type}." if front else "I pick up what is ahead."
  if kind == "DropSubgoal":
    held = level.carrying
    return f"I put down the {held.color} {held.type}." if held else "I put down what I carry."
  return "I follow my plan."


def _describe(datum, level) -> str | None:
  """"the red ball" for an object description, an object, or a cell holding an object."""
  color, kind = getattr(datum, "color", None), getattr(datum, "type", None)
  if kind is None and not hasattr(datum, "color"):  # a position
    cell = level.grid.get(int(datum[0]), int(datum[1]))
    if cell is None or cell.type in ("wall", "floor"):
      return None
    color, kind = cell.color, cell.type
  return "the " + " ".join(part for part in (color, kind or "object") if part)
