"""What the agent sees of a minigrid world, in words, and the routes it can walk.

A `Scene` is built from the agent's egocentric view (7x7 cells by default, walls and closed
doors occlude what lies behind them). It names every visible object "<color> <kind> <k>", with
k = 1 for the nearest of that color and kind, and places it in steps forward and left/right
of the agent. `Routes` is a breadth-first search over (cell, heading) states through the free
cells the agent can see, so a high-level action never walks into something unseen; its
primitive moves are minigrid's turn left, turn right and move forward, each one step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, Iterator

from minigrid.core.actions import Actions
from minigrid.core.constants import DIR_TO_VEC
from minigrid.core.world_object import WorldObj
from minigrid.minigrid_env import MiniGridEnv

Cell = tuple[int, int]
State = tuple[Cell, int]  # (position, heading 0..3: +x, +y, -x, -y)

# The kinds of objects BabyAI places; walls are described only as what blocks the way ahead.
OBJECT_KINDS = ("ball", "box", "key", "door")


def _plural(count: int, noun: str) -> str:
  return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def is_free(cell: WorldObj | None) -> bool:
  """Whether the agent may stand on a cell: empty, an open door, floor (never lava)."""
  return cell is None or (cell.can_overlap() and cell.type != "lava")


def step(cell: Cell, heading: int) -> Cell:
  dx, dy = DIR_TO_VEC[heading]
  return cell[0] + int(dx), cell[1] + int(dy)


def door_state(door: WorldObj) -> str:
  if door.is_locked:
    return "locked"
  return "open" if door.is_open else "closed"


@dataclasses.dataclass(frozen=True)
class SeenObject:
  """A visible object, placed relative to the agent (forward >= 0; right < 0 is left)."""

  kind: str
  color: str
  index: int
  pos: Cell
  forward: int
  right: int
  state: str | None = None  # doors only: "open", "closed" or "locked"

  @property
  def name(self) -> str:
    return f"{self.color} {self.kind} {self.index}"

  @property
  def label(self) -> str:
    return f"{self.name} ({self.state})" if self.state else self.name

  @property
  def where(self) -> str:
    parts = []
    if self.forward:
      parts.append(_plural(self.forward, "step") + " forward")
    if self.right:
      side = "right" if self.right > 0 else "left"
      parts.append(_plural(abs(self.right), "step") + " " + side)
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Route:
  """Primitive actions from the agent's pose to `pos` with heading `heading`."""

  actions: tuple[int, ...]
  pos: Cell
  heading: int


class Routes:
  """Shortest routes by breadth-first search over (cell, heading) through `free` cells.

  Each edge is one primitive action (forward, left, right), so the first state BFS reaches
  that satisfies a goal has the fewest primitive steps, i.e. the best reward.
  """

  def __init__(self, start: State, free: frozenset[Cell]):
    self._parent: dict[State, tuple[State, int] | None] = {start: None}
    self._order = [start]
    queue = collections.deque([start])
    while queue:
      state = queue.popleft()
      pos, heading = state
      moves = ((Actions.forward, (step(pos, heading), heading)),
               (Actions.left, (pos, (heading - 1) % 4)), (Actions.right, (pos, (heading + 1) % 4)))
      for action, nxt in moves:
        if nxt in self._parent or nxt[0] not in free:
          continue
        self._parent[nxt] = (state, int(action))
        self._order.append(nxt)
        queue.append(nxt)

  def to(self, arrived: Callable[[Cell, int], bool]) -> Route | None:
    """The shortest route to a state where `arrived(pos, heading)`, or None if none."""
    for state in self._order:
      if arrived(*state):
        actions = []
        cursor = state
        while (link := self._parent[cursor]) is not None:
          cursor, action = link
          actions.append(action)
        return Route(tuple(reversed(actions)), *state)
    return None

  def facing(self, target: Cell) -> Route | None:
    return self.to(lambda pos, heading: step(pos, heading) == target)

  def onto(self, target: Cell) -> Route | None:
    return self.to(lambda pos, heading: pos == target)


@dataclasses.dataclass(frozen=True)
class Scene:
  """The agent's pose, what it carries and sees, and the routes through what it sees."""

  env: MiniGridEnv
  objects: tuple[SeenObject, ...]  # nearest first
  free: frozenset[Cell]
  ahead: str  # what blocks the way straight ahead, in words

  @property
  def pos(self) -> Cell:
    return tuple(int(v) for v in self.env.agent_pos)

  @property
  def heading(self) -> int:
    return int(self.env.agent_dir)

  @property
  def carrying(self) -> WorldObj | None:
    return self.env.carrying

  @property
  def front(self) -> WorldObj | None:
    return self.cell(step(self.pos, self.heading))

  def cell(self, pos: Cell) -> WorldObj | None:
    return self.env.grid.get(*pos)

  def find(self, color: str, kind: str, index: int) -> SeenObject | None:
    for obj in self.objects:
      if (obj.color, obj.kind, obj.index) == (color, kind, index):
        return obj
    return None

  @functools.cached_property
  def routes(self) -> Routes:
    """Routes from the agent's pose (computed once per Scene; the world is static meanwhile)."""
    return Routes((self.pos, self.heading), self.free | {self.pos})

  def describe(self) -> str:
    """The view in words: visible objects, what is straight ahead, what is carried."""
    if self.objects:
      lines = ["You see:"]
      lines += [f"- {obj.label}: {obj.where}" for obj in self.objects]
    else:
      lines = ["You see no objects."]
    lines.append(self.ahead)
    carrying = self.carrying
    lines.append(f"You are carrying a {carrying.color} {carrying.type}."
                 if carrying else "You are carrying nothing.")
    return "\n".join(lines)


def _visible_cells(env: MiniGridEnv) -> Iterator[tuple[Cell, int, int]]:
  """(cell, forward, right) of every in-world cell the agent sees, the agent's own excluded.

  gen_obs_grid rotates the view so the agent sits at (size // 2, size - 1) looking to -j,
  hence view cell (i, j) lies size - 1 - j steps forward and i - size // 2 steps right.
  """
  _, visible = env.gen_obs_grid()
  size = env.agent_view_size
  (px, py), (fx, fy), (rx, ry) = env.agent_pos, env.dir_vec, env.right_vec
  for i in range(size):
    for j in range(size):
      forward, right = size - 1 - j, i - size // 2
      x = int(px + forward * fx + right * rx)
      y = int(py + forward * fy + right * ry)
      inside = 0 <= x < env.width and 0 <= y < env.height
      if visible[i, j] and inside and (forward, right) != (0, 0):
        yield (x, y), forward, right


def observe(env: MiniGridEnv) -> Scene:
  """Builds the Scene of the agent's current view."""
  free = set()
  seen = []
  placement = {}
  for pos, forward, right in _visible_cells(env):
    placement[pos] = (forward, right)
    cell = env.grid.get(*pos)
    if is_free(cell):
      free.add(pos)
    if cell is not None and cell.type in OBJECT_KINDS:
      seen.append((abs(forward) + abs(right), forward, right, pos, cell))
  # Nearest first; ties broken by forward then right so the numbering is deterministic.
  seen.sort(key=lambda item: item[:3])
  counts: collections.Counter[tuple[str, str]] = collections.Counter()
  objects = []
  for _, forward, right, pos, cell in seen:
    counts[cell.color, cell.type] += 1
    objects.append(
        SeenObject(kind=cell.type, color=cell.color, index=counts[cell.color, cell.type], pos=pos,
                   forward=forward, right=right,
                   state=door_state(cell) if cell.type == "door" else None))
  objects = tuple(objects)
  return Scene(env=env, objects=objects, free=frozenset(free),
               ahead=_ahead(env, objects, placement))


def _ahead(env: MiniGridEnv, objects: tuple[SeenObject, ...],
           placement: dict[Cell, tuple[int, int]]) -> str:
  """What first blocks the straight line ahead, or how far it is clear."""
  names = {obj.pos: obj.label for obj in objects}
  pos, heading = tuple(int(v) for v in env.agent_pos), int(env.agent_dir)
  clear = 0
  while True:
    pos = step(pos, heading)
    if pos not in placement:
      return f"The way ahead is clear for {_plural(clear, 'step')}."
    cell = env.grid.get(*pos)
    if not is_free(cell):
      what = names.get(pos, f"a {cell.type}")
      return f"You are facing {what}, {_plural(clear + 1, 'step')} away."
    clear += 1
