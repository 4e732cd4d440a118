"""TextCraft's expert: the planner of environments.textcraft.oracle, each action with a short
thought derived from the plan ("I need oak planks for the crafting table, so I craft them from
oak logs."), in the env's action format (ReAct, or the tool calls of TextCraft's TOOLS).
Demonstrations (agentgym_jax/demonstrations.py) replay its replies to verify them.
"""

from __future__ import annotations

import re
from typing import Sequence

from environments import base
from environments.textcraft import oracle

_GET = re.compile(r"get (\d+) (.+)")
_CRAFT = re.compile(r"craft (\d+) (.+?) using (.+)")
_GOAL = re.compile(r"Goal: craft (.+)\.\s*$")


def replies(env: base.Env, task_id: int) -> list[str]:
  """The TextCraft oracle's plan, each action with a thought derived from the plan, as replies
  in the env's action format.

  The env is only reset (the oracle reads the first observation, as an agent would).
  """
  first = env.reset(task_id)
  goal = _GOAL.search(first)
  if goal is None:
    raise base.ExpertError(f"task {task_id}: no goal line in {first[-200:]!r}")
  actions = oracle.solve(first)
  return [
      base.reply_for(env, thought(actions, i, goal.group(1)), action)
      for i, action in enumerate(actions)
  ]


def thought(actions: Sequence[str], index: int, goal: str) -> str:
  """A one-sentence reason for actions[index] of an oracle plan for `goal`.

  The item an action makes is wanted by the first later craft that lists it as an ingredient
  (its "user"), which needs (count in the user's command) x (times the user's command is
  repeated in a row) of it; the goal's own craft ends the episode. For the plan
    0 get 2 oak logs                        "To craft the oak planks I need 2 oak logs, which I
                                             can get directly, so I get 2."
    1 craft 4 oak planks using 1 oak logs   "To craft the chest I need 8 oak planks, which I
                                             craft from oak logs."
    2 craft 4 oak planks using 1 oak logs   "I have 4 of the 8 oak planks for the chest, so I
                                             craft again."
    3 craft 1 chest using 8 oak planks      "I have everything for the chest, so I craft it to
                                             reach the goal."
  """
  action = actions[index]
  if match := _GET.fullmatch(action):
    count, item = match.groups()
    user = _textcraft_user(actions, index, item)
    if user is None:
      return f"I can get {item} directly, so I get {count}."
    return (f"To craft the {user[0]} I need {user[1]} {item}, which I can get directly, "
            f"so I get {count}.")
  match = _CRAFT.fullmatch(action)
  if match is None:
    raise base.ExpertError(f"the oracle planned {action!r}, neither get nor craft")
  made_per_craft, target, inputs = match.groups()
  if target == goal:
    return f"I have everything for the {goal}, so I craft it to reach the goal."
  user = _textcraft_user(actions, index, target)
  repeats = _run_length(actions[index::-1])
  if repeats > 1 and user is not None:
    made = int(made_per_craft) * (repeats - 1)
    return f"I have {made} of the {user[1]} {target} for the {user[0]}, so I craft again."
  ingredients = " and ".join(part.partition(" ")[2] for part in inputs.split(", "))
  if user is None:
    return f"I craft {target} from {ingredients}."
  return f"To craft the {user[0]} I need {user[1]} {target}, which I craft from {ingredients}."


def _textcraft_user(actions: Sequence[str], index: int, item: str) -> tuple[str, int] | None:
  """(target, count of `item` it needs) of the first craft after actions[index] using `item`."""
  for position in range(index + 1, len(actions)):
    match = _CRAFT.fullmatch(actions[position])
    if match is None:
      continue
    for part in match.group(3).split(", "):
      count, _, name = part.partition(" ")
      if name == item:
        return match.group(2), int(count) * _run_length(actions[position:])
  return None


def _run_length(actions: Sequence[str]) -> int:
  """How many times actions[0] repeats at the start of `actions`."""
  return next((i for i, action in enumerate(actions) if action != actions[0]), len(actions))
