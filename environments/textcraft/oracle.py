"""An oracle for TextCraft: the whole action list, planned from the first observation's text.

It reads only what an agent reads: the commands, and the names of the generic ingredients
that are made by crafting one of their kinds (planks, wooden slabs, wool), which the
instruction states. For every ingredient name it decides:
  - produced: some command makes it; craft it with its shallowest command;
  - crafted generic: craft the shallowest listed item of its kind (`kind_word`: "oak planks"
    for "planks") and use that instead;
  - base: anything else (gettable generics like "logs" included); get it.
Depth over the listing is the environment's (`recipes.crafting_depths`) with these three cases;
ties go to the command listed first. The plan reserves each recipe's ingredients until the
craft, so that making a later ingredient (sticks from planks) cannot eat an earlier one (the
planks of a pickaxe).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from environments.textcraft.recipes import (Ingredient, RecipeBook, crafting_depths, display_name,
                                            kind_word)

_COMMAND = re.compile(r"craft ([0-9]+) (.+?) using (.+)")
_GOAL = re.compile(r"Goal: craft (.+)\.")


@dataclasses.dataclass(frozen=True)
class _Command:
  """A listed command, with names as listed; `crafting_depths` reads it as a `recipes.Recipe`."""

  output: str
  count: int
  ingredients: tuple[Ingredient, ...]

  def text(self, names: dict[str, str]) -> str:
    inputs = ", ".join(f"{i.count} {names.get(i.item, i.item)}" for i in self.ingredients)
    return f"craft {self.count} {self.output} using {inputs}"


def solve(first_observation: str) -> list[str]:
  """The actions that craft the goal of a TextCraft episode, from its first observation."""
  commands, goal = _parse(first_observation)
  producers: dict[str, list[_Command]] = collections.defaultdict(list)
  for command in commands:
    producers[command.output].append(command)
  crafted_generics = {display_name(name) for name in RecipeBook.load().crafted_generics}
  names = {i.item for c in commands for i in c.ingredients}
  members = {
      item: [output for output in producers if kind_word(output) == kind_word(item)]
            if item in crafted_generics else [] for item in names - set(producers)
  }
  generics = {item: options for item, options in members.items() if options}
  depth = crafting_depths(producers, generics, frozenset(members.keys() - generics.keys()))
  recipe = {
      item: min(options, key=lambda c: max(depth[i.item] for i in c.ingredients))
      for item, options in producers.items()
  }
  # A crafted generic is filled by its shallowest member; min() keeps the first listed on ties.
  stand_in = {item: min(options, key=lambda m: depth[m]) for item, options in generics.items()}

  actions: list[str] = []
  inventory: collections.Counter[str] = collections.Counter()
  reserved: collections.Counter[str] = collections.Counter()

  def ensure(item: str, quantity: int) -> None:
    """Plans actions until `quantity` unreserved `item` are in the inventory."""
    missing = quantity - (inventory[item] - reserved[item])
    if missing <= 0:
      return
    if item not in recipe:
      actions.append(f"get {missing} {item}")
      inventory[item] += missing
      return
    command = recipe[item]
    crafts = math.ceil(missing / command.count)
    needs = [(stand_in.get(i.item, i.item), i.count * crafts) for i in command.ingredients]
    for need, count in needs:
      ensure(need, count)
      reserved[need] += count
    for need, count in needs:
      reserved[need] -= count
      inventory[need] -= count
    actions.extend([command.text(stand_in)] * crafts)
    inventory[item] += command.count * crafts

  ensure(goal, 1)
  return actions


def _parse(observation: str) -> tuple[list[_Command], str]:
  listing, _, goal_line = observation.removeprefix("Crafting commands:\n").rpartition("\n\n")
  goal = _GOAL.fullmatch(goal_line.strip())
  if goal is None:
    raise ValueError(f"not a TextCraft first observation: {observation[:200]!r}")
  commands = []
  for line in listing.splitlines():
    match = _COMMAND.fullmatch(line)
    if match is None:
      raise ValueError(f"not a crafting command: {line!r}")
    ingredients = []
    for part in match.group(3).split(", "):
      count, _, item = part.partition(" ")
      ingredients.append(Ingredient(item, int(count)))
    commands.append(_Command(match.group(2), int(match.group(1)), tuple(ingredients)))
  return commands, goal.group(1)
