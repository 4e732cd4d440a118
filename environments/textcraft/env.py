"""TextCraftEnv: craft a Minecraft item from a list of crafting commands (AgentGym's TextCraft).

Episode. The first observation lists crafting commands, every recipe of the goal's crafting
tree (`RecipeBook.tree`) plus up to `MAX_DISTRACTORS` other recipes that use its items, then
the goal:

  Crafting commands:
  craft 4 stick using 2 planks
  ...

  Goal: craft crafting table.

Actions (AgentGym's grammar and texts; N are decimal counts):
  get N item                    -> "Got N item" if the item is gettable (a base item, or a
                                   generic ingredient with a base member, recipes.py), with
                                   unlimited supply; else "Could not find item".
  craft N target using N a, ... -> "Crafted k minecraft:target": one craft of a recipe of the
                                   target whose ingredients match the list one to one (the same
                                   item or a member of the generic ingredient, the same count);
                                   it makes the recipe's yield k. A generic named as the commands
                                   print it ("4 planks") takes any of its members held, mixed
                                   kinds included (`_consumed`). As in AgentGym the requested
                                   N is not checked: crafting 8 sticks from a recipe yielding 4
                                   takes two crafts of "craft 4 stick using 2 oak planks".
                                   Errors: "Could not find enough items to craft minecraft:t",
                                   "Could not find a valid recipe for minecraft:t",
                                   "Wrong item format: <ingredient without a count>".
  inventory                     -> "Inventory: [item] (n) ..." or
                                   "Inventory: You are not carrying anything."
  anything else                 -> "Could not execute <action>".
Reward 1 and done when the goal is crafted; every other step has reward 0. As in AgentGym, the
game goes on after that: the inventory stays and crafting the goal again pays 1 again (EnvPool
never steps a finished episode; AgentGym's clients may).

Replies. In the tool_call format (environments/base.py) the actions are the tools get, craft
and inventory (TOOLS), and a call that cannot be carried out gets "Invalid tool call: <why>.
...". As AgentGym's client does, the action is the reply's text after its last "Action:"
(the whole reply if there is none) and before any "Instruction:", with every character other
than ASCII letters, digits, commas and spaces removed and runs of spaces collapsed.

Tasks. Two goal sets (`goals=` of TextCraftEnv, env.options.goals in a config):
- "default": the 551 craftable items, all of crafting depth 1-4 (see recipes.py); task id =
  index in the list of goals sorted by name.
- "agentgym": the original AgentGym TextCraft's 544 goals, by its rule: the items of minimum
  crafting depth >= 1 in the recipes its loader keeps, that is every item it keeps a recipe
  for (`_agentgym_keeps`). Seven items of the default set lose all their recipes to its
  loader: purpur slab, purpur stairs, quartz bricks, quartz pillar, quartz slab, quartz stairs
  and snow (recipes of one ingredient named *_block; the alternatives beside a quartz or purpur
  block are never read). Task id = index in the list sorted by crafting depth, as the
  original's, and then by name. The original breaks depth ties, and picks which item of each
  two-item storage cycle (iron ingot/nugget, gold ingot/nugget, honey bottle/block) keeps its
  recipe, by the order the OS lists its recipe files in; its ids therefore vary from machine
  to machine (only its last 11 ids, the depth-4 goals, hold the same items everywhere, in some
  order). Here the cycles resolve as in recipes.py (the nuggets and the honey block are goals),
  and the depths are this game's: the original's own count differs for a few dozen items (iron
  and gold goods when its nuggets make ingots, its tags and dropped recipes).
In either set the test split holds 31/41/25/3 goals of depth 1/2/3/4 (the paper's test set),
the ones ranked first by sha256 of their name; train holds the rest. Both sets rank by the same
key, so every default test goal that the agentgym set holds is one of its test goals too (98 of
100; quartz bricks and quartz stairs give way to birch stairs and polished blackstone slab). The
commands of a task are ordered, and its distractors chosen, by sha256 too, so tasks are the
same on every machine, process and PYTHONHASHSEED.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import re
from typing import Any, Mapping, Sequence

from environments import base
from environments.base import StepResult
from environments.textcraft.recipes import Recipe, RecipeBook, display_name, item_id, kind_word

MAX_DEPTH = 4
GOAL_SETS = ("default", "agentgym")  # see "Tasks" above
TEST_QUOTAS = {1: 31, 2: 41, 3: 25, 4: 3}  # test goals per crafting depth, as in the paper
MAX_DISTRACTORS = 10
# Error observations echo the action; this bounds their length for runaway replies.
_MAX_ECHO_CHARS = 300

_INSTRUCTION = """\
You are given crafting commands for items in Minecraft and a goal item to craft. Each round you \
see an observation and reply with one action.

Actions:
- get N item: take N of a base ingredient, one that cannot be crafted. The supply is \
unlimited.
- craft N target using N a, N b, ...: craft once with one of the given crafting commands. The \
ingredients and their counts must be exactly the command's, and one craft makes the number of \
targets the command states; craft again to make more.
- inventory: list what you are carrying.
Use only the given crafting commands. A command may name a generic ingredient: {crafted} \
are made by crafting any specific kind of them (e.g. "oak planks" for planks), and you name \
that kind in your craft action; others, such as "logs" or "oak logs", you can get as they are.

{reply_format}

Example. Commands "craft 4 stick using 2 planks" and "craft 4 oak planks using 1 oak logs", \
goal: craft stick.
{example}"""
# The instruction's example episode: (thought, action, observation) a turn.
_EXAMPLE = (
    ("Sticks need 2 planks. Oak planks count as planks and come from oak logs.", "get 1 oak logs",
     "Got 1 oak logs"),
    ("Now I turn the oak logs into oak planks.", "craft 4 oak planks using 1 oak logs",
     "Crafted 4 minecraft:oak_planks"),
    ("I have 4 oak planks; 2 of them make the sticks.", "craft 4 stick using 2 oak planks",
     "Crafted 4 minecraft:stick"),
)

TOOLS = (base.Tool(
    "get", "Take N of a base ingredient, one that cannot be crafted. The supply is "
    "unlimited.", "get {count} {item}",
    (base.Parameter("count", "integer", "How many to take."),
     base.Parameter("item", "string", 'The ingredient, e.g. "oak logs".'))),
         base.Tool(
             "craft", "Craft once with one of the given crafting commands: the target, the "
             "number of targets the command makes, and exactly the command's ingredients "
             "and counts. Craft again to make more.", "craft {count} {target} using "
             "{ingredients}",
             (base.Parameter("count", "integer", "How many targets the command makes."),
              base.Parameter("target", "string", 'The item to craft, e.g. "stick".'),
              base.Parameter(
                  "ingredients", "array", 'Each ingredient with its count, as '
                  'the command lists it, e.g. ["2 oak planks"].'))),
         base.Tool("inventory", "List what you are carrying.", "inventory"))

_GET = re.compile(r"get ([0-9]+) (.*)")
_CRAFT = re.compile(r"craft (.*) using (.*)")
_INVENTORY = re.compile(r"inventory")
_COUNTED = re.compile(r"([0-9]+) (.*)")


def parse_action(reply: str) -> str:
  """The action in a model reply, extracted as AgentGym's client does (module docstring), except
  that a line break separates words instead of joining them (its client turns "Challenges\nYour
  turn" into "ChallengesYour turn", which the error observation then echoes)."""
  action = reply.split("Instruction:")[0].split("Action:")[-1]
  action = re.sub(r"[^A-Za-z0-9, ]+", "", re.sub(r"\s+", " ", action))
  return " ".join(action.split())


def _sha256(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


def _agentgym_keeps(recipe: Recipe) -> bool:
  """Whether the original AgentGym TextCraft loads `recipe`.

  Its loader reads a list of alternative items as the list's first item (so only recipes of
  first alternatives, recipes.py) and skips every recipe of one ingredient whose name ends in
  "_block", meant for "9 iron ingots from 1 iron block".
  """
  unpacks_block = len(recipe.ingredients) == 1 and recipe.ingredients[0].item.endswith("_block")
  return recipe.first_alternative and not unpacks_block


@functools.cache
def goals(goal_set: str = "default") -> tuple[tuple[str, int], ...]:
  """(goal item, crafting depth) of every task of `goal_set`; the task id is the index."""
  book = RecipeBook.load()
  if goal_set == "default":
    items = [item for item in book.craftable_items() if 1 <= book.depth[item] <= MAX_DEPTH]
  elif goal_set == "agentgym":
    kept = [
        item for item in book.craftable_items() if any(map(_agentgym_keeps, book.recipes[item]))
    ]
    items = sorted(kept, key=lambda item: (book.depth[item], item))
  else:
    raise ValueError(f"unknown TextCraft goal set {goal_set!r}; goal sets: {', '.join(GOAL_SETS)}")
  return tuple((item, int(book.depth[item])) for item in items)


@functools.cache
def splits(goal_set: str = "default") -> dict[str, tuple[int, ...]]:
  """Task ids of each split of `goal_set`, ascending."""
  table = goals(goal_set)
  test = []
  for depth, quota in TEST_QUOTAS.items():
    ids = [i for i, (_, d) in enumerate(table) if d == depth]
    if len(ids) < quota:
      raise ValueError(f"only {len(ids)} goals of depth {depth}, the test split needs {quota}")
    test.extend(sorted(ids, key=lambda i: _sha256(f"textcraft test {table[i][0]}"))[:quota])
  test_ids = set(test)
  return {
      "test": tuple(sorted(test_ids)),
      "train": tuple(i for i in range(len(table)) if i not in test_ids)
  }


def commands_for(goal: str) -> list[Recipe]:
  """The recipes listed for `goal`: its tree plus distractors, in a fixed shuffled order.

  Distractors are recipes outside the tree that use an item of the tree. So that the listing
  stays unambiguous, none makes an item the tree needs, nor an item of the kind of a
  crafted generic ingredient of the tree (a stone slab next to wooden slabs), which could pass
  for one of its members.
  """
  book = RecipeBook.load()
  tree = book.tree(goal)
  ingredients = {i.item for recipe in tree for i in recipe.ingredients}
  needed = {recipe.output for recipe in tree} | ingredients
  needed |= {member for item in ingredients for member in book.generics.get(item, ())}
  kinds = {kind_word(item) for item in ingredients if item in book.crafted_generics}
  candidates = {
      recipe for item in needed for recipe in book.uses.get(item, ())
      if recipe.output not in needed and not (kinds and kind_word(recipe.output) in kinds)
  }
  distractors = sorted(candidates, key=lambda r: _sha256(f"{goal} distractor {r.command}"))
  listed = tree + distractors[:MAX_DISTRACTORS]
  return sorted(listed, key=lambda r: _sha256(f"{goal} order {r.command}"))


@functools.cache
def first_observation(goal: str) -> str:
  commands = "\n".join(recipe.command for recipe in commands_for(goal))
  return f"Crafting commands:\n{commands}\n\nGoal: craft {display_name(goal)}."


class _ActionFailed(Exception):
  """An action the game refuses; its message is the observation."""


class TextCraftEnv:
  """One TextCraft episode at a time (the `environments.base.Env` protocol)."""

  name = "textcraft"

  def __init__(self, max_depth: int | None = None, action_format: str = "react",
               goals: str = "default"):
    """max_depth: task_ids lists only goals of crafting depth <= max_depth (a curriculum);
    action_format: react or tool_call (environments/base.py; the tools are TOOLS);
    goals: the goal set, "default" or "agentgym" (module docstring, "Tasks")."""
    if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int)
                                  or max_depth < 1):
      raise ValueError(f"max_depth must be an int >= 1 or None, got {max_depth!r}")
    if goals not in GOAL_SETS:
      raise ValueError(f"goals must be one of {', '.join(GOAL_SETS)}, got {goals!r}")
    self._max_depth = max_depth
    self._goal_set = goals
    self.action_format = base.ActionFormat(action_format, TOOLS)
    self._book = RecipeBook.load()
    self._goal: str | None = None
    self._inventory: dict[str, int] = {}
    # The episode's commands as listed and its goal's item id ("minecraft:stick"), as the
    # original's env exposes them (its server's /commands and /goal); None between episodes.
    self.commands: str | None = None
    self.goal: str | None = None

  @property
  def instruction(self) -> str:
    crafted = [display_name(name) for name in self._book.crafted_generics]
    example = "\n".join(f"{self.action_format.reply(thought, action)}\nObservation: {seen}"
                        for thought, action, seen in _EXAMPLE)
    return _INSTRUCTION.format(crafted=", ".join(crafted[:-1]) + " and " + crafted[-1],
                               example=example, reply_format=self.action_format.reply_format())

  def task_ids(self, split: str) -> Sequence[int]:
    ids = splits(self._goal_set)[base.check_split(split)]
    if self._max_depth is None:
      return ids
    return [i for i in ids if self._goals[i][1] <= self._max_depth]

  def task_info(self, task_id: int) -> dict[str, Any]:
    goal, depth = self._goals[self._check_task(task_id)]
    return {"category": f"depth{depth}", "goal": goal, "depth": depth}

  def reset(self, task_id: int) -> str:
    goal, _ = self._goals[self._check_task(task_id)]
    self._goal, self._inventory = goal, {}
    self.commands = "\n".join(recipe.command for recipe in commands_for(goal))
    self.goal = f"minecraft:{goal}"
    return first_observation(goal)

  def step(self, action_text: str) -> StepResult:
    if self._goal is None:
      raise RuntimeError("step() without an episode in progress; call reset() first")
    try:
      action = parse_action(self.action_format.react_reply(action_text))
    except base.ToolCallError as error:
      return StepResult(str(error), 0.0, False, {"success": False, "action": ""})
    try:
      observation, success = self._act(action)
    except _ActionFailed as e:
      observation, success = str(e), False
    return StepResult(observation, float(success), success, {"success": success, "action": action})

  def close(self) -> None:
    self._goal = self.commands = self.goal = None

  @property
  def _goals(self) -> tuple[tuple[str, int], ...]:
    return goals(self._goal_set)

  def _check_task(self, task_id: int) -> int:
    count = len(self._goals)
    if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id < count:
      raise ValueError(f"unknown TextCraft task id {task_id!r}; ids are 0..{count - 1}")
    return task_id

  def _act(self, action: str) -> tuple[str, bool]:
    """Applies one parsed action: (observation, whether the goal was crafted)."""
    if match := _GET.match(action):
      count, item = _count(match.group(1), action), match.group(2)
      if not self._book.is_gettable(item_id(item)):
        raise _ActionFailed(f"Could not find {_echo(item)}")
      self._add(item_id(item), count)
      return f"Got {count} {item}", False
    if match := _CRAFT.match(action):
      return self._craft(match.group(1), match.group(2), action)
    if _INVENTORY.match(action):
      if not self._inventory:
        return "Inventory: You are not carrying anything.", False
      return "Inventory: " + " ".join(
          f"[{display_name(item)}] ({count})" for item, count in self._inventory.items()), False
    raise _ActionFailed(f"Could not execute {_echo(action)}")

  def _craft(self, target_text: str, inputs_text: str, action: str) -> tuple[str, bool]:
    """One craft, checked as AgentGym does: inventory first, then the recipe."""
    if match := _COUNTED.fullmatch(target_text):
      target_text = match.group(2)
    target = item_id(target_text)
    inputs = []
    for part in inputs_text.split(","):
      match = _COUNTED.fullmatch(part.strip())
      if match is None:
        raise _ActionFailed(f"Wrong item format: {_echo(part.strip())}")
      inputs.append((item_id(match.group(2)), _count(match.group(1), action)))
    consumed = _consumed(self._inventory, inputs, self._book)
    if consumed is None:
      raise _ActionFailed(f"Could not find enough items to craft minecraft:{_echo(target)}")
    recipe = next((r for r in self._book.recipes.get(target, ()) if self._matches(r, inputs)), None)
    if recipe is None:
      raise _ActionFailed(f"Could not find a valid recipe for minecraft:{_echo(target)}")
    for item, count in consumed.items():
      self._inventory[item] -= count
      if not self._inventory[item]:
        del self._inventory[item]
    self._add(target, recipe.count)
    return f"Crafted {recipe.count} minecraft:{target}", target == self._goal

  def _matches(self, recipe: Recipe, inputs: list[tuple[str, int]]) -> bool:
    """Whether the inputs fill the recipe's slots one to one with the right counts."""
    slots = list(recipe.ingredients)
    if len(slots) != len(inputs):
      return False

    def assign(k: int, free: tuple[int, ...]) -> bool:
      if k == len(inputs):
        return True
      item, count = inputs[k]
      return any(slots[s].count == count and self._book.satisfies(item, slots[s].item)
                 and assign(k + 1, free[:j] + free[j + 1:]) for j, s in enumerate(free))

    return assign(0, tuple(range(len(slots))))

  def _add(self, item: str, count: int) -> None:
    if count:
      self._inventory[item] = self._inventory.get(item, 0) + count


def _consumed(inventory: Mapping[str, int], inputs: Sequence[tuple[str, int]],
              book: RecipeBook) -> dict[str, int] | None:
  """The held items a craft of `inputs` ((named item, count) pairs) uses up, or None when the
  inventory holds too few.

  A name takes the held items that fill it as a recipe slot (`RecipeBook.satisfies`): an item
  only itself; a generic ingredient any of its members held, mixed kinds included as in a
  Minecraft tag slot, so that a command works as the first observation prints it ("4 planks").
  A generic takes first the held item of its own name (a gotten "logs"), so a craft that names
  what it holds uses just that, then the others in the order the inventory observation lists
  them, the order they were obtained (one used up and obtained again goes last): the player can
  see which kinds go first, and nothing else decides. Plain items are served first, then
  generics from the narrowest, so a wide generic ("logs") never spends an item that a narrower
  name ("oak logs", "oak log") of the same craft needs.
  """
  left = dict(inventory)
  consumed: collections.Counter[str] = collections.Counter()
  for item, count in sorted(inputs, key=lambda named: len(book.generics.get(named[0], ()))):
    fillers = sorted((held for held in left if book.satisfies(held, item)),
                     key=lambda held: held != item)
    for held in fillers:
      taken = min(count, left[held])
      left[held] -= taken
      consumed[held] += taken
      count -= taken
    if count:
      return None
  return +consumed


def _count(digits: str, action: str) -> int:
  """A count from the action; too many digits for an int is an unexecutable action."""
  try:
    return int(digits)
  except ValueError as e:  # Python caps int() at 4300 digits.
    raise _ActionFailed(f"Could not execute {_echo(action)}") from e


def _echo(text: str) -> str:
  return text if len(text) <= _MAX_ECHO_CHARS else text[:_MAX_ECHO_CHARS] + "..."
