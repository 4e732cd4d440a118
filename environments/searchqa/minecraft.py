"""A multi-hop question set and its corpus, generated from Minecraft's game data.

SearchQA needs a corpus and questions; the paper's (wiki-18 and seven QA sets) are tens of
gigabytes. This module builds a small, real stand-in from the `minecraft-data` package (Java
1.16.5), which the project already depends on, so the environment runs with no download.

Corpus: one page per item (its display name is the title; the six items Minecraft names
"Banner Pattern" are titled by their ids, "Flower Banner Pattern"), one per group of
interchangeable ingredients ("Planks", "Wool", "Oak Logs"), and one per mob that drops
something. Item pages state what the data says: the crafting recipes that make it ("Recipe: 3
Cobblestone + 2 Stick -> 1 Stone Pickaxe."), the items it is an ingredient of, the groups
it counts as, what it drops when mined, the mobs that drop it, its stack size and, for food,
the hunger points it restores. Mob pages state their drops. The recipes are TextCraft's
(`RecipeBook`: minecraft-data's tag-expanded recipes folded back into generic ingredients),
plus the storage recipes TextCraft drops to break cycles ("9 Iron Nugget -> 1 Iron Ingot"),
restored from the raw data so that the pages are complete.

Questions chain one-hop *clues*, noun phrases that name an item through a fact on one page:
  drop      "the item that a Creeper always drops"        -> Gunpowder    (page Creeper)
  mined     "the item that Diamond Ore drops when mined without Silk Touch"  (page Diamond Ore)
  only use  "the only item crafted from Magma Cream"      -> Magma Block  (page Magma Cream)
  only ingredient  "the only ingredient of Paper"         -> Sugar Cane   (page Paper)
  other ingredient "the ingredient besides Planks in the recipe for Bookshelf" -> Book
  combination      "the item crafted from just Gunpowder and Sand" -> TNT (page TNT)
Clues nest: a clue applies to the item another clue names ("the only item crafted from the
item that a Magma Cube always drops"), up to MAX_HOPS of them. Questions ask for
  name      the item a clue of two or more hops names            ("What is <clue>?")
  count     how many of an ingredient a clued item's recipe takes ("How many Stick does the
            recipe for <clue> use?"), or how many of a clued item a named item's recipe takes
  food      how many hunger points a clued food restores
A question's hops are the pages that hold its facts, in the order a reader needs them; each
question needs 2 or 3 (its category is "<hops>-hop <kind>", e.g. "2-hop count").

Unambiguous by construction: every clue has exactly one answer under the game's rules, where
an item also fills the slots of the groups it belongs to ("Oak Planks" fill "Planks"):
"only use" needs exactly one item crafted from it, directly or through a group, and its page
to list that item (so not only through a group); "only" and
"other ingredient" need every recipe of the item to have the same ingredients; "combination"
needs exactly one item whose recipe two ingredients can fill; "drop" needs exactly one
guaranteed drop; "mined" needs exactly one drop without Silk Touch, not the block itself; a
count needs every recipe of the item to take the same number, at least MIN_COUNT. A clue
never comes back to an item it passed through, and name questions whose answer is written in
the question are dropped. Answers are item titles or numbers (digits or words).

Splits, deterministic: everything is built in sorted order; within a category, questions are
capped so that no answer holds more than MAX_ANSWER_SHARE of them and ordered round-robin over
answers, each answer's questions by the sha256 of their text (`_balanced`); the first
`TEST_PER_CATEGORY` (at most half the category) form the test split, the rest train.
Categories of fewer than MIN_CATEGORY_SIZE questions are left out. No `hash()`, no unseeded
randomness.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from typing import Iterable, Iterator, Sequence

import minecraft_data

from environments.searchqa.qa_data import Question
from environments.searchqa.reply import normalize_answer
from environments.searchqa.retrievers import Doc
from environments.textcraft.recipes import MINECRAFT_VERSION, Ingredient, Recipe, RecipeBook

TEST_PER_CATEGORY = 60
# Smaller categories (3-hop food questions: 2) are left out; a test score over one question is
# noise, not a breakdown.
MIN_CATEGORY_SIZE = 20
MAX_HOPS = 3
# Count questions ask for at least this many: recipes that take one of an ingredient are the
# majority, and a set of mostly "1" answers rewards a policy that always answers "1".
MIN_COUNT = 2
# No answer is shared by more than this fraction of a category's questions (`_balanced`).
MAX_ANSWER_SHARE = 0.25
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen")


@dataclasses.dataclass(frozen=True)
class Hop:
  """A page a reader must find, the names that lead to it, and the sentence with the fact.

  The names are in the question or in the evidence of earlier hops: the page's own title when
  a fact names the page, the two ingredients for "the item crafted from just A and B" (a
  search for both, or the intersection of the two pages' ingredient-of lists, finds it).
  """

  title: str
  evidence: str
  names: tuple[str, ...]

  @property
  def query(self) -> str:
    return " ".join(self.names)


@dataclasses.dataclass(frozen=True)
class _Clue:
  """A noun phrase that names `target` through the facts on the pages of `hops`."""

  target: str  # an item id
  phrase: str
  hops: tuple[Hop, ...]
  items: frozenset[str]  # the items it names or passes through, target included


def _title_case(name: str) -> str:
  return " ".join(word.capitalize() for word in name.split("_"))


def _join(parts: Sequence[str], conjunction: str = "and") -> str:
  """["a"] -> "a"; ["a", "b", "c"] -> "a, b and c"."""
  return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} {conjunction} {parts[-1]}"


def _article(title: str) -> str:
  return "an" if title[0] in "AEIOU" else "a"


def _pages_read(hops: Sequence[Hop]) -> int:
  """The number of page visits: consecutive hops on one page need one search."""
  return sum(1 for i, hop in enumerate(hops) if i == 0 or hop.title != hops[i - 1].title)


class World:
  """The game facts the pages state and the questions ask about (module docstring)."""

  def __init__(self):
    data = minecraft_data(MINECRAFT_VERSION)
    book = RecipeBook.load()
    self.items = {item["name"]: item for item in data.items_list}
    self.groups = dict(book.generics)
    self.recipes: dict[str, tuple[Recipe, ...]] = dict(
        sorted({**book.recipes, **_storage_recipes(data, book)}.items()))
    self.blocks = frozenset(block["name"] for block in data.blocks_list)
    self.food = {food["name"]: food for food in data.foods_list}
    self.block_loot = {
        name: entries for name, entries in data.blockLoot.items() if name in self.items
    }
    entity_titles = {entity["name"]: entity["displayName"] for entity in data.entities_list}
    self.mob_drops = {
        entry["entity"]: entry["drops"] for entry in data.entityLoot_list if entry["drops"]
    }

    display_counts = collections.Counter(item["displayName"] for item in data.items_list)
    self.titles = {
        name:
            (item["displayName"] if display_counts[item["displayName"]] == 1 else _title_case(name))
        for name, item in self.items.items()
    }
    self.titles.update({group: _title_case(group) for group in self.groups})
    taken = {title.lower() for title in self.titles.values()}
    self.mob_titles = {}
    for mob in sorted(self.mob_drops):
      title = entity_titles[mob]
      self.mob_titles[mob] = f"{title} (mob)" if title.lower() in taken else title
    all_titles = [*self.titles.values(), *self.mob_titles.values()]
    duplicates = [t for t, n in collections.Counter(t.lower() for t in all_titles).items() if n > 1]
    if duplicates:
      raise ValueError(f"page titles are not unique: {duplicates}")

    uses = collections.defaultdict(set)
    for output, recipes in self.recipes.items():
      for recipe in recipes:
        for ingredient in recipe.ingredients:
          uses[ingredient.item].add(output)
    self.uses = {name: tuple(sorted(outputs)) for name, outputs in uses.items()}
    self.member_of = collections.defaultdict(list)
    for group, members in sorted(self.groups.items()):
      for member in members:
        self.member_of[member].append(group)

  # Facts with a unique answer (None when there is none or more than one).

  def all_uses(self, name: str) -> set[str]:
    """Items crafted from `name`, directly or through a group it belongs to."""
    outputs = set(self.uses.get(name, ()))
    for group in self.member_of.get(name, ()):
      outputs.update(self.uses.get(group, ()))
    return outputs

  def only_use(self, name: str) -> str | None:
    """The one item crafted from `name`, when its page lists it (not only its group's)."""
    outputs = self.all_uses(name)
    if len(outputs) != 1 or outputs != set(self.uses.get(name, ())):
      return None
    return outputs.pop()

  def ingredient_set(self, name: str) -> tuple[str, ...] | None:
    """The ingredients of `name` when all its recipes have the same ones, in recipe order."""
    recipes = self.recipes.get(name, ())
    sets = {frozenset(i.item for i in recipe.ingredients) for recipe in recipes}
    if len(sets) != 1:
      return None
    return tuple(i.item for i in recipes[0].ingredients)

  def only_ingredient(self, name: str) -> str | None:
    ingredients = self.ingredient_set(name)
    if ingredients and len(ingredients) == 1 and ingredients[0] in self.items:
      return ingredients[0]
    return None

  def other_ingredient(self, name: str, known: str) -> str | None:
    ingredients = self.ingredient_set(name)
    if not ingredients or len(ingredients) != 2 or known not in ingredients:
      return None
    other = ingredients[1 - ingredients.index(known)]
    return other if other in self.items else None

  def count(self, name: str, ingredient: str) -> int | None:
    """How many `ingredient` every recipe of `name` takes, when they all take the same."""
    counts = {
        next((i.count for i in recipe.ingredients if i.item == ingredient), None)
        for recipe in self.recipes.get(name, ())
    }
    return counts.pop() if len(counts) == 1 and None not in counts else None

  def fills(self, item: str, slot: str) -> bool:
    return item == slot or item in self.groups.get(slot, ())

  def always_drop(self, mob: str) -> str | None:
    always = {drop["item"] for drop in self.mob_drops[mob] if drop["dropChance"] == 1}
    return always.pop() if len(always) == 1 else None

  def mined_drop(self, block: str) -> str | None:
    """The one item `block` drops without Silk Touch, when it is not the block itself."""
    entries = self.block_loot.get(block, ())
    plain = [e for e in entries if not e.get("silkTouch") and not e.get("noSilkTouch")]
    without_silk = {e["item"] for e in entries if e.get("noSilkTouch")}
    if plain or len(without_silk) != 1 or block in without_silk:
      return None
    return without_silk.pop()

  def combinations(self) -> dict[tuple[str, str], tuple[str, Recipe]]:
    """(a, b) -> the one item, and its recipe, made from exactly two named items a < b.

    Only pairs written in some recipe count; the pair is kept when no other recipe of any
    item can be filled by the two (in either order, members filling their groups).
    """
    two_slot = [
        recipe for recipes in self.recipes.values() for recipe in recipes
        if len(recipe.ingredients) == 2
    ]
    found = {}
    for recipe in two_slot:
      pair = tuple(sorted(i.item for i in recipe.ingredients))
      if not all(item in self.items for item in pair) or pair in found:
        continue
      outputs = {
          other.output for other in two_slot
          if self._fill_both(pair, [i.item for i in other.ingredients])
      }
      if outputs == {recipe.output}:
        found[pair] = (recipe.output, recipe)
    return dict(sorted(found.items()))

  def _fill_both(self, pair: Sequence[str], slots: Sequence[str]) -> bool:
    a, b = pair
    return ((self.fills(a, slots[0]) and self.fills(b, slots[1]))
            or (self.fills(a, slots[1]) and self.fills(b, slots[0])))

  # Page text.

  def recipe_sentence(self, recipe: Recipe) -> str:
    inputs = " + ".join(f"{i.count} {self.titles[i.item]}" for i in recipe.ingredients)
    return f"Recipe: {inputs} -> {recipe.count} {self.titles[recipe.output]}."

  def uses_sentence(self, name: str) -> str:
    outputs = sorted(self.titles[output] for output in self.uses.get(name, ()))
    if not outputs:
      return "It is not an ingredient of any crafting recipe."
    return f"It is an ingredient of: {', '.join(outputs)}."

  def mob_drop_sentences(self, mob: str) -> list[str]:
    drops = self.mob_drops[mob]
    always = sorted(
        self.titles[d["item"]] for d in drops if d["dropChance"] == 1 and not d.get("playerKill"))
    always_by_player = sorted(
        self.titles[d["item"]] for d in drops if d["dropChance"] == 1 and d.get("playerKill"))
    sometimes = sorted(self.titles[d["item"]] for d in drops if d["dropChance"] < 1)
    sentences = []
    if always:
      sentences.append(f"When killed, it always drops {_join(always)}.")
    if always_by_player:
      sentences.append(f"When killed by a player, it always drops {_join(always_by_player)}.")
    if sometimes:
      sentences.append(f"It sometimes drops {_join(sometimes)}.")
    return sentences

  def mined_sentence(self, block: str) -> str | None:
    entries = self.block_loot.get(block, ())

    def drops(selected) -> str:
      names = sorted({"itself" if e["item"] == block else self.titles[e["item"]] for e in selected})
      return _join(names, "or") if names else "nothing"

    with_silk = [e for e in entries if e.get("silkTouch")]
    without_silk = [e for e in entries if e.get("noSilkTouch")]
    plain = [e for e in entries if not e.get("silkTouch") and not e.get("noSilkTouch")]
    if with_silk or without_silk:
      return (f"Mined with Silk Touch, it drops {drops(with_silk)}; mined without Silk Touch, it "
              f"drops {drops(without_silk)}.")
    if plain and {e["item"] for e in plain} != {block}:
      return f"When mined, it can drop {drops(plain)}."
    return None

  def item_page(self, name: str) -> Doc:
    item, title = self.items[name], self.titles[name]
    sentences = [
        f"{title} is an item in Minecraft Java Edition {MINECRAFT_VERSION} (id "
        f"minecraft:{name})."
    ]
    recipes = self.recipes.get(name, ())
    sentences.extend(self.recipe_sentence(recipe) for recipe in recipes)
    if not recipes:
      sentences.append("It has no crafting recipe.")
    sentences.append(self.uses_sentence(name))
    for group in self.member_of.get(name, ()):
      group_title = self.titles[group]
      sentences.append(f"It counts as {group_title} in recipes that ask for {group_title}.")
    if name in self.blocks:
      sentences.append("It can be placed as a block.")
      mined = self.mined_sentence(name)
      if mined:
        sentences.append(mined)
    droppers = sorted(self.mob_titles[mob] for mob, drops in self.mob_drops.items()
                      if any(drop["item"] == name for drop in drops))
    if droppers:
      sentences.append(f"It is dropped by these mobs: {', '.join(droppers)}.")
    stack = item["stackSize"]
    sentences.append(f"It stacks up to {stack}." if stack > 1 else "It does not stack.")
    if name in self.food:
      food = self.food[name]
      sentences.append(f"Eating it restores {food['foodPoints']} hunger points and "
                       f"{food['saturation']:g} saturation.")
    return Doc(title, " ".join(sentences))

  def group_page(self, group: str) -> Doc:
    title = self.titles[group]
    members = _join(sorted(self.titles[member] for member in self.groups[group]), "or")
    return Doc(
        title, f"{title} is a group of interchangeable crafting ingredients in Minecraft "
        f"Java Edition {MINECRAFT_VERSION}: a recipe that asks for {title} accepts "
        f"any of {members}. {self.uses_sentence(group)}")

  def mob_page(self, mob: str) -> Doc:
    title = self.mob_titles[mob]
    sentences = [
        f"{title} is a mob in Minecraft Java Edition {MINECRAFT_VERSION}.",
        *self.mob_drop_sentences(mob)
    ]
    return Doc(title, " ".join(sentences))

  def pages(self) -> list[Doc]:
    """The corpus: items, then groups, then mobs, each sorted by id."""
    return ([self.item_page(name) for name in sorted(self.items)] +
            [self.group_page(group) for group in sorted(self.groups)] +
            [self.mob_page(mob) for mob in sorted(self.mob_drops)])


def _storage_recipes(data, book: RecipeBook) -> dict[str, tuple[Recipe, ...]]:
  """The recipes of outputs that the recipe book left without any (its dropped cycles).

  They involve no item tags ("9 Iron Nugget -> 1 Iron Ingot"), so each raw recipe is one
  recipe; ingredients are listed by name.
  """
  names = {item["id"]: item["name"] for item in data.items_list}
  restored = collections.defaultdict(set)
  for entries in data.recipes.values():
    for entry in entries:
      output = names[entry["result"]["id"]]
      if output in book.recipes:
        continue
      cells = ([c for row in entry["inShape"] for c in row]
               if "inShape" in entry else entry["ingredients"])
      counts = collections.Counter(names[c] for c in cells if c is not None)
      restored[output].add(
          Recipe(output, entry["result"]["count"],
                 tuple(Ingredient(item, n) for item, n in sorted(counts.items()))))
  return {
      output: tuple(sorted(recipes, key=lambda r: [(i.item, i.count) for i in r.ingredients]))
      for output, recipes in restored.items()
  }


class _QuestionWriter:
  """Enumerates the clues and questions of the module docstring over a World."""

  def __init__(self, world: World):
    self.world = world
    self.titles = world.titles
    self.combinations_with = collections.defaultdict(list)
    for (a, b), made in world.combinations().items():
      self.combinations_with[a].append((b, made))
      self.combinations_with[b].append((a, made))

  def first_clues(self) -> Iterator[_Clue]:
    """Clues of one hop: from a mob, a mined block, or a named item."""
    world, titles = self.world, self.titles
    for mob in sorted(world.mob_drops):
      drop = world.always_drop(mob)
      if drop:
        mob_title = world.mob_titles[mob]
        yield _Clue(drop, f"the item that {_article(mob_title)} {mob_title} always drops",
                    (Hop(mob_title, f"always drops {titles[drop]}.", (mob_title,)),),
                    frozenset({drop}))
    for block in sorted(world.items):
      drop = world.mined_drop(block)
      if drop:
        yield _Clue(drop, f"the item that {titles[block]} drops when mined without Silk Touch",
                    (Hop(titles[block], f"mined without Silk Touch, it drops {titles[drop]}.",
                         (titles[block],)),), frozenset({block, drop}))
    for name in sorted(world.items):
      yield from self.extend(_Clue(name, titles[name], (), frozenset({name})))

  def extend(self, clue: _Clue) -> Iterator[_Clue]:
    """The clues one hop past `clue`: facts on the page of its target, or naming it.

    A clue never returns to an item it already named or passed through.
    """
    world, titles, item = self.world, self.titles, clue.target
    page = titles[item]

    def deeper(target: str, phrase: str, hop: Hop, named: Iterable[str] = ()) -> Iterator[_Clue]:
      if target not in clue.items:
        yield _Clue(target, phrase, clue.hops + (hop,), clue.items | {target, *named})

    used_for = world.only_use(item)
    if used_for:
      yield from deeper(used_for, f"the only item crafted from {clue.phrase}",
                        Hop(page, world.uses_sentence(item), (page,)))
    if item in world.recipes:
      recipe_hop = Hop(page, world.recipe_sentence(world.recipes[item][0]), (page,))
      only = world.only_ingredient(item)
      if only:
        yield from deeper(only, f"the only ingredient of {clue.phrase}", recipe_hop)
      for known in world.ingredient_set(item) or ():
        other = world.other_ingredient(item, known)
        if other:
          yield from deeper(
              other, f"the ingredient besides {titles[known]} in the recipe for "
              f"{clue.phrase}", recipe_hop, (known,))
    for partner, (made, recipe) in self.combinations_with.get(item, ()):
      if not clue.hops and partner < item:
        continue  # a pair of named items is one clue, not two
      # The named partner comes first: "crafted from Sand and the item that ..." parses one way.
      yield from deeper(made, f"the item crafted from just {titles[partner]} and {clue.phrase}",
                        Hop(titles[made], world.recipe_sentence(recipe), (titles[partner], page)),
                        (partner,))

  def questions(self) -> Iterator[tuple[str, str, tuple[str, ...], tuple[Hop, ...]]]:
    """(kind, question, golden answers, hops) of every question of 2 to MAX_HOPS hops."""
    clues = list(self.first_clues())
    frontier = clues
    while frontier:
      frontier = [
          deeper for clue in frontier if len(clue.hops) < MAX_HOPS for deeper in self.extend(clue)
      ]
      clues.extend(frontier)
    for clue in clues:
      candidates = [("name", f"What is {clue.phrase}?", (self.titles[clue.target],), clue.hops),
                    *self._questions_about(clue)]
      if len(clue.hops) == 1:
        candidates.extend(self._counts_of(clue))
      for question in candidates:
        if 2 <= _pages_read(question[3]) <= MAX_HOPS:
          yield question

  def _questions_about(self, clue: _Clue):
    """Count and food questions answered on the page of the item `clue` names."""
    world, item, page = self.world, clue.target, self.titles[clue.target]
    for ingredient in world.ingredient_set(item) or ():
      count = world.count(item, ingredient)
      if count is None or count < MIN_COUNT:
        continue
      recipe = next(
          r for r in world.recipes[item] if any(i.item == ingredient for i in r.ingredients))
      yield ("count", f"How many {self.titles[ingredient]} does the recipe for {clue.phrase} use?",
             _number_answers(count), clue.hops + (Hop(page, world.recipe_sentence(recipe),
                                                      (page,)),))
    if item in world.food:
      points = world.food[item]["foodPoints"]
      yield ("food", f"How many hunger points does {clue.phrase} restore when eaten?",
             _number_answers(points),
             clue.hops + (Hop(page, f"Eating it restores {points} hunger points", (page,)),))

  def _counts_of(self, clue: _Clue):
    """How many of a clued item the recipes of the items it is used in take."""
    world, ingredient = self.world, clue.target
    for output in world.uses.get(ingredient, ()):
      count = world.count(output, ingredient)
      if count is None or count < MIN_COUNT or output in clue.items:
        continue
      recipe = world.recipes[output][0]
      yield ("count", f"How many of {clue.phrase} does the recipe for {self.titles[output]} use?",
             _number_answers(count),
             clue.hops + (Hop(self.titles[output], world.recipe_sentence(recipe),
                              (self.titles[output],)),))


def _number_answers(number: int) -> tuple[str, ...]:
  return (str(number), NUMBER_WORDS[number]) if number < len(NUMBER_WORDS) else (str(number),)


def _answer_in_question(answers: Sequence[str], question: str) -> bool:
  normalized = f" {normalize_answer(question)} "
  return any(f" {normalize_answer(answer)} " in normalized for answer in answers)


def _sha256(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Dataset:
  """The generated corpus and its questions, split."""

  pages: tuple[Doc, ...]
  test: tuple[Question, ...]
  train: tuple[Question, ...]


def _balanced(questions: Sequence[Question]) -> list[Question]:
  """One category's questions, at most MAX_ANSWER_SHARE of them with the same answer, ordered
  round-robin over answers (each answer's questions by sha256 of their text).

  The cap is the largest c with c <= MAX_ANSWER_SHARE * sum over answers of min(n_answer, c)
  (at least 1), so that a constant guess scores at most that share of a category.
  """
  by_answer = collections.defaultdict(list)
  for question in sorted(questions, key=lambda q: _sha256(q.question)):
    by_answer[normalize_answer(question.golden_answers[0])].append(question)
  groups = [by_answer[answer] for answer in sorted(by_answer)]
  cap = max(len(group) for group in groups)
  while cap > 1 and cap > MAX_ANSWER_SHARE * sum(min(len(group), cap) for group in groups):
    cap -= 1
  rounds = [[group[i] for group in groups if i < len(group)] for i in range(cap)]
  return [question for round_ in rounds for question in round_]


@functools.cache
def dataset() -> Dataset:
  """The corpus and the test/train questions (built on first use, then cached)."""
  world = World()
  by_category: dict[str, dict[str, Question]] = collections.defaultdict(dict)
  for kind, text, answers, hops in _QuestionWriter(world).questions():
    if kind == "name" and _answer_in_question(answers, text):
      continue
    category = f"{_pages_read(hops)}-hop {kind}"
    key = _sha256(text)
    by_category[category].setdefault(
        key,
        Question(id=f"minecraft-{key[:16]}", question=text, golden_answers=answers,
                 category=category, metadata={"kind": kind, "hops": tuple(hops)}))
  test, train = [], []
  for category in sorted(by_category):
    if len(by_category[category]) < MIN_CATEGORY_SIZE:
      continue
    ordered = _balanced(list(by_category[category].values()))
    num_test = min(TEST_PER_CATEGORY, len(ordered) // 2)
    test.extend(ordered[:num_test])
    train.extend(ordered[num_test:])
  return Dataset(tuple(world.pages()), tuple(test), tuple(train))
