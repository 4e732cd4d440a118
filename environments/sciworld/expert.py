"""SciWorld's expert: ScienceWorld's gold action sequence, each action with a thought of its verb,
in the env's action format (ReAct, or the tool calls of SciWorld's TOOLS).
"""

from __future__ import annotations

import re

from environments import base

# (action prefix, thought template over the rest of the action), first match wins.
_SCIWORLD_THOUGHTS = (
    ("look around", "I look around to see what is here."),
    ("look at ", "I examine the {}."),
    ("look in ", "I check what is inside the {}."),
    ("read ", "I read the {}."),
    ("open door to ", "The way to the {} is through this door, so I open it."),
    ("open ", "I open the {}."),
    ("close ", "I close the {}."),
    ("go to ", "I go to the {}."),
    ("pick up ", "I need the {}, so I pick it up."),
    ("put down ", "I put down the {}."),
    ("move ", "I move the {}."),
    ("pour ", "I pour the {}."),
    ("dunk ", "I dunk the {}."),
    ("mix ", "I mix what is in the {}."),
    ("activate ", "I turn on the {}."),
    ("deactivate ", "I turn off the {}."),
    ("use ", "I use the {}."),
    ("connect ", "I connect the {}."),
    ("disconnect ", "I disconnect the {}."),
    ("eat ", "I eat the {}."),
    ("flush ", "I flush the {}."),
    ("focus on ", "The task is about the {}, so I focus on it."),
    ("wait", "I let time pass for the process to go on."),
    ("inventory", "I check what I am carrying."),
    ("task", "I read the task again."),
)


def replies(env: base.Env, task_id: int) -> list[str]:
  """ScienceWorld's gold action sequence for the task, each action with a verb's thought."""
  gold_actions = getattr(env, "gold_actions", None)
  if gold_actions is None:
    raise base.ExpertError(f"{type(env).__name__} has no gold_actions (needs the SciWorld adapter)")
  return [base.reply_for(env, thought(action), action) for action in gold_actions(task_id)]


def thought(action: str) -> str:
  """A sentence for a ScienceWorld action: "move X to Y" -> "I move the X to Y."."""
  if action.isdigit():
    return f"Several things match my action; I choose option {action}."
  for prefix, template in _SCIWORLD_THOUGHTS:
    if action == prefix.strip() or action.startswith(prefix):
      rest = action[len(prefix):]
      rest = re.sub(r" (to|in|on|into) ", r" \1 the ", rest, count=1)
      return template.format(rest)
  return "This is the next step of my plan."
