"""The text actions of BabyAI: parsing a reply, and expanding an action into primitive moves.

Grammar (case-insensitive; "the"/"a" before the color and a missing k, meaning 1, are allowed):
  turn left | turn right | move forward | toggle | drop | check available actions
  go to <color> <kind> <k>               kind in ball, box, key, door
  pick up <color> <kind> <k>             ("pickup" too; bare "pick up" takes what is in front)
  go through <color> door <k>            an open door
  toggle and go through <color> door <k> a closed door, or a locked one with its key in hand

`expand` turns an action into minigrid primitives (Actions ints) using the routes of the
current Scene, or raises ActionError with the message the agent reads. The list of available
actions is exactly the candidate actions that expand without error, so the two never disagree.
"""

from __future__ import annotations

import dataclasses
import re

from minigrid.core.actions import Actions
from minigrid.core.constants import COLOR_NAMES

from environments.babyai import scene as scene_lib

CHECK = "check available actions"
_SIMPLE = ("turn left", "turn right", "move forward", "toggle", "drop", "pick up", CHECK)
_TARGETED = ("go to", "pick up", "go through", "toggle and go through")
_TARGET_RE = re.compile(r"(toggle and go through|go through|go to|pick up)\s+(?:(?:the|a|an)\s+)?"
                        r"([a-z]+)\s+([a-z]+)(?:\s+(\d{1,6}))?")
_ACTION_MARK = re.compile(r"action\s*:", re.IGNORECASE)


class ActionError(ValueError):
  """An action that cannot be carried out now; the message is shown to the agent."""


@dataclasses.dataclass(frozen=True)
class Command:
  verb: str  # one of _SIMPLE or _TARGETED
  color: str | None = None
  kind: str | None = None
  index: int | None = None

  @property
  def target(self) -> str:
    return f"{self.color} {self.kind} {self.index}"

  @property
  def text(self) -> str:
    return f"{self.verb} {self.target}" if self.kind else self.verb


def extract_action(reply: str) -> str:
  """The action part of a "Thought: ...\\n\\nAction: ..." reply, normalized.

  The first non-empty line after the last "Action:" marker; without a marker the whole reply.
  Lowercased, whitespace collapsed, surrounding quotes/backticks/brackets and a final period
  dropped.
  """
  marks = list(_ACTION_MARK.finditer(reply))
  text = reply[marks[-1].end():] if marks else reply
  if marks:
    text = next((line for line in text.splitlines() if line.strip()), "")
  text = " ".join(text.lower().split())
  return text.strip("\"'`[]<>*").strip().rstrip(".").strip()


def has_action_mark(reply: str) -> bool:
  return _ACTION_MARK.search(reply) is not None


def parse(action: str) -> Command | None:
  """A normalized action string -> Command, or None if it is not in the grammar."""
  action = re.sub(r"^pickup\b", "pick up", action)
  if action in _SIMPLE:
    return Command(action)
  match = _TARGET_RE.fullmatch(action)
  if match is None:
    return None
  verb, color, kind, index = match.groups()
  if color not in COLOR_NAMES or kind not in scene_lib.OBJECT_KINDS:
    return None
  if verb in ("go through", "toggle and go through") and kind != "door":
    return None
  return Command(verb, color, kind, int(index) if index else 1)


def expand(command: Command, scene: scene_lib.Scene) -> tuple[int, ...]:
  """Primitive minigrid actions that carry out `command` from `scene`; ActionError if none."""
  verb = command.verb
  if verb == CHECK:
    return ()
  if verb == "turn left":
    return (Actions.left,)
  if verb == "turn right":
    return (Actions.right,)
  if verb == "move forward":
    if not scene_lib.is_free(scene.front):
      raise ActionError(f"You cannot move forward: there is a {scene.front.type} in front of you.")
    return (Actions.forward,)
  if verb == "drop":
    if scene.carrying is None:
      raise ActionError("You cannot drop anything: you are not carrying anything.")
    if scene.front is not None:
      raise ActionError(f"You cannot drop here: there is a {scene.front.type} in front of you.")
    return (Actions.drop,)
  if verb == "toggle":
    front = scene.front
    if front is None or front.type not in ("door", "box"):
      raise ActionError("There is nothing in front of you to toggle.")
    if front.type == "door":
      _check_unlockable(front.color, scene_lib.door_state(front), "the door in front of you", scene)
    return (Actions.toggle,)
  if verb == "pick up" and command.kind is None:
    _check_hands_free(scene)
    if scene.front is None or not scene.front.can_pickup():
      raise ActionError("There is nothing in front of you to pick up.")
    return (Actions.pickup,)

  obj = scene.find(command.color, command.kind, command.index)
  if obj is None:
    raise ActionError(f"You do not see a {command.target}.")
  routes = scene.routes
  if verb == "go to":
    route = _require(routes.facing(obj.pos), obj)
    # Already facing it: a no-op step (minigrid's "done") lets the level check a go-to mission.
    return route.actions or (Actions.done,)
  if verb == "pick up":
    if obj.kind == "door":
      raise ActionError("You cannot pick up a door.")
    _check_hands_free(scene)
    return _require(routes.facing(obj.pos), obj).actions + (Actions.pickup,)
  if verb == "go through":
    if obj.state != "open":
      raise ActionError(f"The {obj.name} is {obj.state}: use \"toggle and go through "
                        f"{obj.name}\" to open it and go through.")
    route = _require(routes.onto(obj.pos), obj)
    return route.actions + _step_beyond(route.pos, route.heading, scene)
  # toggle and go through
  if obj.state == "open":
    raise ActionError(f"The {obj.name} is already open: use \"go through {obj.name}\".")
  _check_unlockable(obj.color, obj.state, f"the {obj.name}", scene)
  route = _require(routes.facing(obj.pos), obj)
  return (route.actions + (Actions.toggle, Actions.forward) +
          _step_beyond(obj.pos, route.heading, scene))


def available(scene: scene_lib.Scene) -> list[str]:
  """Every action that `expand` accepts in `scene`, in a fixed order."""
  candidates = [
      Command(verb) for verb in ("turn left", "turn right", "move forward", "toggle", "drop")
  ]
  for verb in _TARGETED:
    for obj in scene.objects:
      if verb in ("go through", "toggle and go through") and obj.kind != "door":
        continue
      candidates.append(Command(verb, obj.color, obj.kind, obj.index))
  names = []
  for command in candidates:
    try:
      expand(command, scene)
    except ActionError:
      continue
    names.append(command.text)
  return names + [CHECK]


def _require(route: scene_lib.Route | None, obj: scene_lib.SeenObject) -> scene_lib.Route:
  if route is None:
    raise ActionError(f"There is no path to the {obj.name} through the cells you can see.")
  return route


def _check_hands_free(scene: scene_lib.Scene) -> None:
  if scene.carrying is not None:
    raise ActionError(f"You are already carrying a {scene.carrying.color} "
                      f"{scene.carrying.type}; drop it first.")


def _check_unlockable(color: str, state: str, what: str, scene: scene_lib.Scene) -> None:
  carrying = scene.carrying
  if state == "locked" and (carrying is None or (carrying.type, carrying.color) != ("key", color)):
    raise ActionError(f"You cannot open {what}: it is locked and you are not carrying "
                      f"a {color} key.")


def _step_beyond(door: scene_lib.Cell, heading: int, scene: scene_lib.Scene) -> tuple[int, ...]:
  """One more step forward off the doorway into the next room, when that cell is free."""
  x, y = scene_lib.step(door, heading)
  inside = 0 <= x < scene.env.width and 0 <= y < scene.env.height
  return (Actions.forward,) if inside and scene_lib.is_free(scene.cell((x, y))) else ()
