"""TextCraft's recipe book: Minecraft 1.16 crafting recipes rebuilt from `minecraft-data`.

`minecraft-data` (the PyPI package `minecraft_data`, data of Java 1.16.5) ships the shaped and
shapeless crafting recipes with every item tag already expanded: the crafting table appears as
eight recipes, one per kind of planks, and the campfire as 64 (32 logs x {coal, charcoal}).
This module turns them back into the recipes a player reads, in four steps.

1. Factor. The variants of one output that share a layout (the grid's empty cells, or the
   ingredient count of a shapeless recipe) and a yield are split into slots: grid positions
   whose items vary together across the variants. When the variants are exactly the Cartesian
   product of the slots' alternatives (true for every recipe of 1.16), each slot is one
   ingredient with a set of alternatives and a count (its number of cells).
2. Name. A slot with four or more alternatives is one of Minecraft's item tags, a family with
   one member per wood species or colour; it becomes a *generic ingredient* named as the tag
   (`planks`, `wool`, `wooden_slabs`, `logs`, `oak_logs`, `crimson_stems`; see
   `_generic_name`). Smaller alternative sets are Minecraft's short item lists (coal or
   charcoal, cobblestone or blackstone) or distinct recipes that happen to share a layout
   (poppy or red tulip -> red dye); each alternative is kept as a recipe of its own, which is
   equivalent and reads better than an invented name. The recipe of the first alternatives
   is marked (`Recipe.first_alternative`): AgentGym's loader reads a list of alternatives as
   its first item and knows only that recipe (environments/textcraft/env.py, "agentgym"
   goals). Distinct recipes that share a layout are recipes of their own in AgentGym too;
   the mark on them decides no goal.
3. Break storage cycles. Some items are crafted from each other and from nothing else (iron
   ingot <-> iron block <-> iron nugget, wheat <-> hay bale, honey bottle <-> honey block), so
   no chain of recipes starts at a base item. In each such cycle the item that the most other
   items are crafted from (ties: the alphabetically first) becomes a base item: its recipes are
   dropped, as AgentGym drops "9 ingots from 1 block". Cycles that are grounded elsewhere
   (sandstone slab <-> chiseled sandstone) are kept: they only add a useless detour.
4. Classify. Base items are ingredients that no recipe makes; the agent can `get` them. A
   generic ingredient with a base member (`logs`, `oak_logs`) is itself gettable, as in
   AgentGym where such tags are leaves of the crafting tree; one whose members are all crafted
   (`planks`, `wool`, `wooden_slabs`) is obtained by crafting any member. Every member of a
   crafted generic has the generic's `kind_word` (oak planks for planks, oak slab for wooden
   slabs); with the instruction, which names the crafted generics, the text alone tells what
   fills them.

Crafting depth (see `RecipeBook.depth`):
  depth(x) = 0                                   x a base item or a gettable generic,
  depth(g) = min over members m of depth(m)      g a crafted generic,
  depth(x) = min over recipes r of x of (1 + max over ingredients i of r of depth(i)).
So depth 1 means some recipe of x needs only base items; depth 2 means some recipe needs only
items of depth <= 1 and none of depth 1 suffices; and so on.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import threading
from typing import Iterable, Mapping, Sequence

import minecraft_data

MINECRAFT_VERSION = "1.16.5"

# A slot with at least this many alternatives is a Minecraft item tag (see the module docstring).
_MIN_GENERIC_MEMBERS = 4
_LOG_KINDS = frozenset({"log", "wood", "stem", "hyphae"})
_LOAD_LOCK = threading.Lock()  # see RecipeBook.load


def display_name(item: str) -> str:
  """"oak_planks" -> "oak planks": how items appear in commands and observations."""
  return item.replace("_", " ")


def item_id(text: str) -> str:
  """"oak planks" -> "oak_planks": the inverse of `display_name`."""
  return text.replace(" ", "_")


def kind_word(name: str) -> str:
  """The kind of thing an item or generic ingredient is: its last word, without a plural "s".

  "oak_planks" and "planks" -> "plank", "oak slab" and "wooden_slabs" -> "slab". Every member
  of a crafted generic ingredient has the generic's kind, which is how a reader of the commands
  tells that "oak planks" fill "planks".
  """
  return name.replace("_", " ").rpartition(" ")[2].removesuffix("s")


@dataclasses.dataclass(frozen=True)
class Ingredient:
  """`count` of `item`, an item id ("oak_planks") or a generic ingredient ("planks")."""

  item: str
  count: int


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One craft: the ingredients in, `count` of `output` out."""

  output: str
  count: int
  ingredients: tuple[Ingredient, ...]
  # Whether each ingredient is the first alternative of its slot (step 2 of the module
  # docstring); true for a recipe without alternatives.
  first_alternative: bool = dataclasses.field(default=True, compare=False)

  @property
  def command(self) -> str:
    """The command that performs this craft, e.g. "craft 4 stick using 2 planks"."""
    inputs = ", ".join(f"{i.count} {display_name(i.item)}" for i in self.ingredients)
    return f"craft {self.count} {display_name(self.output)} using {inputs}"


@dataclasses.dataclass(frozen=True)
class _Variant:
  """One recipe as minecraft-data stores it: concrete items, grid cells row-major."""

  layout: tuple  # what variants of one tag-expanded recipe share
  cells: tuple[str | None, ...]


class RecipeBook:
  """All recipes, generic ingredients, base items and crafting depths.

  Build it once (`RecipeBook.load()` is cached); it is immutable afterwards.
  """

  def __init__(self, recipes: Iterable[Recipe], generics: dict[str, frozenset[str]]):
    self.generics = dict(generics)
    by_output: dict[str, list[Recipe]] = collections.defaultdict(list)
    for recipe in recipes:
      by_output[recipe.output].append(recipe)
    self.recipes = _break_storage_cycles(by_output, self.generics)
    made = set(self.recipes)
    used = {i.item for rs in self.recipes.values() for r in rs for i in r.ingredients}
    concrete = (used - set(self.generics)) | set().union(*self.generics.values())
    self.base_items = frozenset(concrete - made)
    self.depth = crafting_depths(self.recipes, self.generics, self.base_items)
    collisions = set(self.generics) & (concrete | made)
    if collisions:
      raise ValueError(f"generic ingredient names collide with items: {sorted(collisions)}")
    # Generic ingredients without a base member: planks, wooden_slabs, wool.
    self.crafted_generics = tuple(
        sorted(name for name in self.generics if not self.is_gettable(name)))
    # Item -> the recipes that use it, directly or as a member of a generic ingredient.
    uses: dict[str, list[Recipe]] = collections.defaultdict(list)
    for output_recipes in self.recipes.values():
      for recipe in output_recipes:
        for ingredient in recipe.ingredients:
          for item in (ingredient.item, *sorted(self.generics.get(ingredient.item, ()))):
            uses[item].append(recipe)
    self.uses = dict(uses)

  @classmethod
  def load(cls) -> RecipeBook:
    """The recipe book of Minecraft `MINECRAFT_VERSION`, built once per process.

    Threads asking while it is built (a pool or a server making many adapters at once) wait
    for that build rather than each reading all of minecraft-data again.
    """
    with _LOAD_LOCK:
      return cls._build()

  @classmethod
  @functools.cache
  def _build(cls) -> RecipeBook:
    variants = _load_variants()
    recipes, generics = [], {}
    for output in sorted(variants):
      recipes.extend(_factor(output, variants[output], generics))
    return cls(recipes, generics)

  def is_gettable(self, item: str) -> bool:
    """Whether `get N item` works: base items and generics with a base member."""
    if item in self.generics:
      return not self.generics[item].isdisjoint(self.base_items)
    return item in self.base_items

  def satisfies(self, item: str, ingredient: str) -> bool:
    """Whether inventory item `item` can fill a recipe slot asking for `ingredient`.

    A member fills its generic ("oak planks" fill "planks"), and so does a gotten generic
    whose members all belong to it ("oak logs" fill "logs").
    """
    members = self.generics.get(ingredient, frozenset())
    return item == ingredient or item in members or self.generics.get(item, members) < members

  def craftable_items(self) -> list[str]:
    """Items that some recipe makes, sorted by name."""
    return sorted(self.recipes)

  def tree(self, goal: str) -> list[Recipe]:
    """Every recipe that can take part in crafting `goal`, depth first from the goal.

    All recipes of each crafted item are included (the agent may pick any). Gettable generics
    are leaves; a crafted generic (`planks`) contributes its members of minimal depth.
    """
    tree: list[Recipe] = []
    visited: set[str] = set()

    def visit(item: str) -> None:
      if item in visited:
        return
      visited.add(item)
      if item in self.generics:
        if self.is_gettable(item):
          return
        best = min(self.depth[m] for m in self.generics[item])
        for member in sorted(self.generics[item]):
          if self.depth[member] == best:
            visit(member)
        return
      for recipe in self.recipes.get(item, ()):
        tree.append(recipe)
        for ingredient in recipe.ingredients:
          visit(ingredient.item)

    visit(goal)
    return tree


def _load_variants() -> dict[str, list[_Variant]]:
  """minecraft-data's crafting recipes by output item name."""
  data = minecraft_data(MINECRAFT_VERSION)
  names = {item["id"]: item["name"] for item in data.items_list}
  variants: dict[str, list[_Variant]] = collections.defaultdict(list)
  for entries in data.recipes.values():
    for entry in entries:
      result = entry["result"]
      if "inShape" in entry:
        rows = entry["inShape"]
        cells = tuple(None if c is None else names[c] for row in rows for c in row)
        layout = ("shaped", tuple(len(row) for row in rows), tuple(c is None for c in cells))
      else:
        cells = tuple(names[c] for c in entry["ingredients"])
        layout = ("shapeless", len(cells))
      variants[names[result["id"]]].append(_Variant((*layout, result["count"]), cells))
  return variants


def _factor(output: str, variants: Sequence[_Variant],
            generics: dict[str, frozenset[str]]) -> list[Recipe]:
  """Rebuilds the recipes of `output` from its tag-expanded variants (steps 1 and 2).

  Adds the generic ingredients it names to `generics`.
  """
  groups: dict[tuple, list[tuple[str | None, ...]]] = {}
  for variant in variants:
    groups.setdefault(variant.layout, []).append(variant.cells)
  recipes = []
  for layout, group in groups.items():
    slots = _slots(group)
    if math.prod(len(alternatives) for alternatives, _ in slots) != len(set(group)):
      raise ValueError(f"the {output} recipes of layout {layout} are not a product of "
                       f"independent alternatives: {group}")
    options = []
    for alternatives, count in slots:
      if len(alternatives) >= _MIN_GENERIC_MEMBERS:
        name = _generic_name(alternatives)
        generics[name] = frozenset(alternatives)
        options.append([Ingredient(name, count)])
      else:
        options.append([Ingredient(item, count) for item in alternatives])
    for choice in itertools.product(*(enumerate(option) for option in options)):
      first = all(index == 0 for index, _ in choice)
      recipes.append(Recipe(output, layout[-1], _merge(i for _, i in choice), first))
  return recipes


def _slots(group: Sequence[tuple[str | None, ...]]) -> list[tuple[tuple[str, ...], int]]:
  """Positions whose items vary together across `group`: (alternatives, number of cells).

  Slots and alternatives are in order of first appearance (row-major), which is the order
  ingredients are listed in commands.
  """
  positions: dict[tuple[str | None, ...], int] = {}
  for column in zip(*group):
    if column[0] is not None:
      positions[column] = positions.get(column, 0) + 1
  return [(tuple(dict.fromkeys(column)), count) for column, count in positions.items()]


def _merge(ingredients: Iterable[Ingredient]) -> tuple[Ingredient, ...]:
  """Adds up the counts of repeated items, keeping the order of first appearance."""
  counts: dict[str, int] = {}
  for ingredient in ingredients:
    counts[ingredient.item] = counts.get(ingredient.item, 0) + ingredient.count
  return tuple(Ingredient(item, count) for item, count in counts.items())


def _generic_name(members: Sequence[str]) -> str:
  """The Minecraft tag name of a family of alternatives (step 2)."""
  kinds = {member.rsplit("_", 1)[-1] for member in members}
  if kinds <= _LOG_KINDS:
    species = {member.removeprefix("stripped_").rsplit("_", 1)[0] for member in members}
    if len(species) > 1:
      return "logs"
    (single,) = species
    return f"{single}_stems" if kinds <= {"stem", "hyphae"} else f"{single}_logs"
  if kinds == {"slab"}:
    return "wooden_slabs"
  if len(kinds) == 1:
    return kinds.pop()  # planks, wool
  raise ValueError(f"cannot name the generic ingredient with members {sorted(members)}")


def _break_storage_cycles(by_output: dict[str, list[Recipe]],
                          generics: dict[str, frozenset[str]]) -> dict[str, tuple[Recipe, ...]]:
  """Drops the recipes of the most used item of each ungrounded cycle (step 3)."""
  recipes = {output: list(rs) for output, rs in by_output.items()}
  uses = collections.Counter(
      item for rs in recipes.values() for item in {i.item for r in rs for i in r.ingredients})
  while True:
    made = set(recipes)
    concrete = {i.item for rs in recipes.values() for r in rs for i in r.ingredients}
    base = (concrete | set().union(*generics.values())) - made - set(generics)
    depth = crafting_depths(recipes, generics, frozenset(base))
    ungrounded = {item for item in made if depth[item] == math.inf}
    if not ungrounded:
      return {output: tuple(rs) for output, rs in sorted(recipes.items())}
    on_cycle = [item for item in sorted(ungrounded) if item in _reachable(item, recipes, generics)]
    if not on_cycle:
      raise ValueError(f"items that no recipe chain grounds: {sorted(ungrounded)}")
    del recipes[min(on_cycle, key=lambda item: (-uses[item], item))]


def _reachable(start: str, recipes: dict[str, list[Recipe]],
               generics: dict[str, frozenset[str]]) -> set[str]:
  """Items that `start` is (transitively) crafted from; `start` among them iff on a cycle."""
  seen: set[str] = set()
  stack = [start]
  while stack:
    item = stack.pop()
    for recipe in recipes.get(item, ()):
      for ingredient in recipe.ingredients:
        for needed in (ingredient.item, *generics.get(ingredient.item, ())):
          if needed not in seen:
            seen.add(needed)
            stack.append(needed)
  return seen


def crafting_depths(recipes: Mapping[str, Sequence[Recipe]], generics: Mapping[str, Iterable[str]],
                    base_items: frozenset[str]) -> dict[str, float]:
  """Crafting depth of every item and generic (the module docstring's equations; a gettable
  generic has depth 0 as the least depth of its members, one of them a base item).

  A fixed point iteration: depths only decrease, from infinity, so it ends after at most as
  many rounds as there are items. Unreachable items keep depth infinity.
  """
  depth: dict[str, float] = collections.defaultdict(lambda: math.inf)
  for item in base_items:
    depth[item] = 0
  changed = True
  while changed:
    changed = False
    for name, members in generics.items():
      best = min(depth[m] for m in members)
      if best < depth[name]:
        depth[name], changed = best, True
    for output, output_recipes in recipes.items():
      best = min(1 + max(depth[i.item] for i in r.ingredients) for r in output_recipes)
      if best < depth[output]:
        depth[output], changed = best, True
  return dict(depth)
