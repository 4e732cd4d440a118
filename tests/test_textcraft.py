"""TextCraft: recipes rebuilt from minecraft-data, AgentGym's action grammar and texts, tasks
and splits that are the same in every process, an oracle that solves every goal, and a reply
parser that never raises."""

import collections
import functools
import hashlib
import json
import math
import re

import hypothesis
import pytest
from hypothesis import strategies as st

import environments
from environments.base import Env
from environments.textcraft import RecipeBook, TextCraftEnv, parse_action, solve
from environments.textcraft import env as env_lib
from environments.textcraft.recipes import display_name, item_id, kind_word
from env_helpers import run_python


def _reply(action: str) -> str:
  return f"Thought: one step closer.\n\nAction: {action}"


def _task_id(goal: str) -> int:
  return [g for g, _ in env_lib.goals()].index(goal)


def _episode(goal: str) -> TextCraftEnv:
  env = TextCraftEnv()
  env.reset(_task_id(goal))
  return env


def _observations(env: TextCraftEnv, *actions: str) -> list[str]:
  return [env.step(_reply(action)).observation for action in actions]


@pytest.fixture(scope="module")
def book() -> RecipeBook:
  return RecipeBook.load()


# The recipe book.


def test_tag_variants_are_merged_into_agentgym_style_generic_ingredients(book):
  # minecraft-data stores the crafting table as 8 recipes, one per kind of planks.
  assert [r.command for r in book.recipes["crafting_table"]
         ] == ["craft 1 crafting table using 4 planks"]
  assert book.generics["planks"] == {
      f"{wood}_planks"
      for wood in ("oak", "spruce", "birch", "jungle", "acacia", "dark_oak", "crimson", "warped")
  }
  assert sorted(book.generics) == sorted(
      ["planks", "wool", "wooden_slabs", "logs", "crimson_stems", "warped_stems"] +
      [f"{wood}_logs" for wood in ("oak", "spruce", "birch", "jungle", "acacia", "dark_oak")])
  # Minecraft 1.16's tag wooden_slabs: one slab per kind of planks, no stone slab.
  assert book.generics["wooden_slabs"] == {
      planks.replace("planks", "slab") for planks in book.generics["planks"]
  }
  assert len(book.generics["logs"]) == 32 and len(book.generics["wool"]) == 16
  assert book.generics["oak_logs"] == {
      "oak_log", "oak_wood", "stripped_oak_log", "stripped_oak_wood"
  }
  assert [r.command for r in book.recipes["oak_planks"]] == ["craft 4 oak planks using 1 oak logs"]
  # 64 variants (32 logs x {coal, charcoal}): logs is a tag, coal-or-charcoal a short list that
  # stays two recipes.
  assert [r.command for r in book.recipes["campfire"]] == [
      "craft 1 campfire using 3 stick, 1 coal, 3 logs",
      "craft 1 campfire using 3 stick, 1 charcoal, 3 logs"
  ]
  # AgentGym's loader reads the first item of a list of alternatives: coal, not charcoal.
  assert [r.first_alternative for r in book.recipes["campfire"]] == [True, False]
  # Distinct recipes that share a layout are not merged into an invented ingredient.
  assert sorted(r.command for r in book.recipes["red_dye"]) == [
      "craft 1 red dye using 1 beetroot", "craft 1 red dye using 1 poppy",
      "craft 1 red dye using 1 red tulip", "craft 2 red dye using 1 rose bush"
  ]


def test_storage_cycles_make_the_most_used_item_base(book):
  # ingot <-> block <-> nugget has no base item; the ingot is used by the most recipes.
  assert book.is_gettable("iron_ingot") and "iron_ingot" not in book.recipes
  assert [r.command for r in book.recipes["iron_block"]
         ] == ["craft 1 iron block using 9 iron ingot"]
  assert [r.command for r in book.recipes["iron_nugget"]
         ] == ["craft 9 iron nugget using 1 iron ingot"]
  assert book.is_gettable("honey_bottle") and not book.is_gettable("honey_block")
  assert all(book.depth[item] < float("inf") for item in book.recipes)


def test_crafting_depth_worked_examples(book):
  # stick: 2 bamboo (base) -> 1. crafting table: planks (1, from gettable oak logs) -> 2.
  # lodestone: stone (0) -> stone bricks 1 -> stone brick slab 2 -> chiseled stone bricks 3
  # -> lodestone 4 (its netherite ingot, from scrap and gold, is only 1).
  expected = {
      "stick": 1, "iron_block": 1, "planks": 1, "crafting_table": 2, "painting": 2,
      "wooden_slabs": 2, "composter": 3, "chiseled_stone_bricks": 3, "lodestone": 4, "logs": 0,
      "oak_log": 0
  }
  assert {item: book.depth[item] for item in expected} == expected


def test_members_of_crafted_generics_share_its_kind_word(book):
  assert book.crafted_generics == ("planks", "wooden_slabs", "wool")
  for generic in book.crafted_generics:
    assert {kind_word(member) for member in book.generics[generic]} == {kind_word(generic)}
  assert kind_word("wooden_slabs") == kind_word("dark oak slab") == "slab"


# Tasks and splits.


def test_splits_are_stratified_disjoint_and_cover_every_goal():
  env = TextCraftEnv()
  train, test = env.task_ids("train"), env.task_ids("test")
  assert len(test) == 100 and len(train) == len(env_lib.goals()) - 100
  assert not set(train) & set(test)
  assert sorted(train + test) == list(range(len(env_lib.goals())))
  assert list(test) == sorted(test) and list(train) == sorted(train)
  assert collections.Counter(env.task_info(i)["depth"] for i in test) == {1: 31, 2: 41, 3: 25, 4: 3}
  depths = {env.task_info(i)["depth"] for i in train}
  assert depths == {1, 2, 3, 4}
  info = env.task_info(_task_id("crafting_table"))
  assert info == {"category": "depth2", "goal": "crafting_table", "depth": 2}


def test_max_depth_keeps_the_shallow_goals_of_a_split():
  full, shallow = TextCraftEnv(), TextCraftEnv(max_depth=2)
  for split in ("train", "test"):
    expected = [i for i in full.task_ids(split) if full.task_info(i)["depth"] <= 2]
    assert list(shallow.task_ids(split)) == expected
  assert len(shallow.task_ids("test")) == 31 + 41
  assert len(shallow.task_ids("train")) == 352
  for bad in (0, -1, 1.5, True, "2"):
    with pytest.raises(ValueError, match="max_depth"):
      TextCraftEnv(max_depth=bad)


# The original AgentGym TextCraft's goals: its 11 goals of crafting depth 4, which are its last
# 11 ids whatever order the OS lists its recipe files in.
_AGENTGYM_DEPTH_4 = ("cyan_banner", "gray_banner", "hopper_minecart", "lectern", "lime_banner",
                     "lodestone", "polished_andesite_slab", "polished_andesite_stairs",
                     "polished_granite_slab", "polished_granite_stairs", "purple_banner")
# Default goals whose every recipe the original's loader drops (one ingredient named *_block,
# or an alternative beside such a block).
_NOT_AGENTGYM = ("purpur_slab", "purpur_stairs", "quartz_bricks", "quartz_pillar", "quartz_slab",
                 "quartz_stairs", "snow")


def test_agentgym_goal_set_is_the_originals_544_in_a_fixed_order():
  table = env_lib.goals("agentgym")
  names = [goal for goal, _ in table]
  assert len(table) == 544 and len(set(names)) == 544
  # sha256 of the ordered names: the order is pinned across machines and Python versions.
  digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
  assert digest == "b037efe2441b7fa2d45c9424a86b8ea8db4bddf4893ef45503fbc516b14fba74"
  # Sorted by depth as the original, then by name.
  assert table == tuple(sorted(table, key=lambda goal_depth: (goal_depth[1], goal_depth[0])))
  assert collections.Counter(depth for _, depth in table) == {1: 144, 2: 273, 3: 116, 4: 11}
  default = {goal for goal, _ in env_lib.goals()}
  assert sorted(default - set(names)) == list(_NOT_AGENTGYM) and set(names) < default
  # Storage cycles resolve as in the recipe book: the ingots are base items, the nuggets goals.
  assert {"iron_nugget", "gold_nugget", "honey_block"} <= set(names)
  assert not {"iron_ingot", "gold_ingot", "honey_bottle"} & set(names)


def test_agentgym_spot_ids_hold_the_originals_goal_items():
  env = environments.make("textcraft", goals="agentgym")
  spots = {
      0: "acacia_planks", 143: "yellow_dye", 144: "acacia_boat", 417: "activator_rail",
      533: "cyan_banner", 538: "lodestone", 543: "purple_banner"
  }
  assert {i: env.task_info(i)["goal"] for i in spots} == spots
  assert [env.task_info(i)["goal"] for i in range(533, 544)] == list(_AGENTGYM_DEPTH_4)
  assert {env.task_info(i)["depth"] for i in range(533, 544)} == {4}
  assert env.reset(538).endswith("\n\nGoal: craft lodestone.") and env.goal == "minecraft:lodestone"
  with pytest.raises(ValueError, match=r"ids are 0\.\.543"):
    env.reset(544)


def test_agentgym_split_is_picked_as_the_default_split():
  default, agentgym = TextCraftEnv(), TextCraftEnv(goals="agentgym")
  train, test = agentgym.task_ids("train"), agentgym.task_ids("test")
  assert len(test) == 100 and len(train) == 444 and sorted(train + test) == list(range(544))
  assert collections.Counter(
      agentgym.task_info(i)["depth"] for i in test) == {1: 31, 2: 41, 3: 25, 4: 3}
  # The same ranking: every default test goal the set holds is a test goal here.
  default_test = {default.task_info(i)["goal"] for i in default.task_ids("test")}
  agentgym_test = {agentgym.task_info(i)["goal"] for i in test}
  assert sorted(default_test - agentgym_test) == ["quartz_bricks", "quartz_stairs"]
  assert sorted(agentgym_test - default_test) == ["birch_stairs", "polished_blackstone_slab"]
  shallow = TextCraftEnv(max_depth=2, goals="agentgym")
  assert len(shallow.task_ids("test")) == 31 + 41
  for bad in ("AgentGym", "", None, 544):
    with pytest.raises(ValueError, match="goals must be one of default, agentgym"):
      TextCraftEnv(goals=bad)


def test_bad_task_ids_and_splits_raise():
  env = TextCraftEnv()
  for bad in (-1, len(env_lib.goals()), "3", True, 1.0):
    with pytest.raises(ValueError, match="unknown TextCraft task id"):
      env.reset(bad)
  with pytest.raises(ValueError, match="unknown split"):
    env.task_ids("validation")
  with pytest.raises(RuntimeError, match="call reset"):
    env.step(_reply("inventory"))


def test_registered_and_implements_the_protocol():
  env = environments.make("textcraft")
  assert isinstance(env, TextCraftEnv) and isinstance(env, Env)
  assert "planks, wooden slabs and wool" in env.instruction
  assert "Thought: <your reasoning>\n\nAction: <one action>" in env.instruction


def test_first_observation_lists_the_tree_and_at_most_10_distractors(book):
  for task_id in (0, _task_id("crafting_table"), _task_id("lodestone"), len(env_lib.goals()) - 1):
    goal = env_lib.goals()[task_id][0]
    observation = TextCraftEnv().reset(task_id)
    header, listing, goal_line = re.fullmatch(
        r"(Crafting commands:)\n(.*)\n\n(Goal: craft [a-z ]+\.)", observation, re.S).groups()
    assert goal_line == f"Goal: craft {goal.replace('_', ' ')}."
    lines = listing.split("\n")
    assert all(
        re.fullmatch(r"craft \d+ [a-z ]+ using \d+ [a-z ]+(, \d+ [a-z ]+)*", line)
        for line in lines)
    assert len(set(lines)) == len(lines)
    tree = {recipe.command for recipe in book.tree(goal)}
    assert tree <= set(lines) and len(set(lines) - tree) <= env_lib.MAX_DISTRACTORS
  crafting_table = TextCraftEnv().reset(_task_id("crafting_table"))
  assert "craft 1 crafting table using 4 planks" in crafting_table
  assert "craft 4 oak planks using 1 oak logs" in crafting_table


# Run in fresh interpreters and in this one: what must not depend on the process.
_FINGERPRINT = """
import hashlib
from environments.textcraft import TextCraftEnv

def fingerprint():
  env = TextCraftEnv()
  ids = range(len(env.task_ids("train")) + len(env.task_ids("test")))
  observations = "\\n\\n".join(env.reset(i) for i in ids)
  agentgym = TextCraftEnv(goals="agentgym")
  return {"test": list(env.task_ids("test")), "goals": [env.task_info(i)["goal"] for i in ids],
          "observations": hashlib.sha256(observations.encode()).hexdigest(),
          "agentgym": [agentgym.task_info(i)["goal"] for i in range(544)],
          "agentgym_test": list(agentgym.task_ids("test"))}
"""


def test_tasks_are_identical_across_processes_and_hash_seeds():
  outputs = [
      json.loads(
          run_python("-c", _FINGERPRINT + "import json; print(json.dumps(fingerprint()))",
                     hash_seed=seed, timeout=120)) for seed in ("0", "4242")
  ]
  namespace = {}
  exec(_FINGERPRINT, namespace)
  assert outputs[0] == outputs[1] == namespace["fingerprint"]()
  assert outputs[0]["goals"][_task_id("lodestone")] == "lodestone"


# Actions and observations.


def test_get_base_items_and_gettable_generics_only():
  env = _episode("crafting_table")
  assert _observations(env, "get 2 oak log", "get 1 oak logs", "get 3 logs", "get 1 planks",
                       "get 1 stick", "get 1 crafting table", "get 1 unobtainium") == [
                           "Got 2 oak log", "Got 1 oak logs", "Got 3 logs", "Could not find planks",
                           "Could not find stick", "Could not find crafting table",
                           "Could not find unobtainium"
                       ]
  assert _observations(env, "inventory") == ["Inventory: [oak log] (2) [oak logs] (1) [logs] (3)"]


def test_every_error_text():
  env = _episode("crafting_table")
  assert _observations(env, "inventory") == ["Inventory: You are not carrying anything."]
  assert _observations(
      env,
      "craft 1 crafting table using 4 oak planks",  # nothing in the inventory yet
      "craft 1 crafting table using 4 planks",  # nor any planks to fill the generic
      "craft 1 crafting table using oak planks",  # an ingredient without a count
      "dance",
      "",
      "Get 1 oak log",  # not an action (the grammar is case-sensitive)
      "get 1 oak log",
      "craft 4 oak planks using 1 oak log",
      "craft 1 crafting table using 3 oak planks",  # wrong count
      "craft 1 furnace using 4 oak planks",  # not a recipe of the target
      "craft 1 unobtainium using 1 oak planks") == [
          "Could not find enough items to craft minecraft:crafting_table",
          "Could not find enough items to craft minecraft:crafting_table",
          "Wrong item format: oak planks", "Could not execute dance", "Could not execute ",
          "Could not execute Get 1 oak log", "Got 1 oak log", "Crafted 4 minecraft:oak_planks",
          "Could not find a valid recipe for minecraft:crafting_table",
          "Could not find a valid recipe for minecraft:furnace",
          "Could not find a valid recipe for minecraft:unobtainium"
      ]
  # Failed crafts consume nothing.
  assert _observations(env, "inventory") == ["Inventory: [oak planks] (4)"]


def test_generic_ingredients_take_any_one_member():
  env = _episode("crafting_table")
  _observations(env, "get 2 birch logs", "craft 4 birch planks using 1 birch logs",
                "craft 4 birch planks using 1 birch logs")
  # As in AgentGym, a slot named by kinds is filled by one item: 2 oak + 2 birch planks is not
  # a recipe (named as printed, "4 planks" takes a mix).
  assert _observations(env, "get 1 oak log", "craft 4 oak planks using 1 oak log",
                       "craft 1 crafting table using 2 oak planks, 2 birch planks") == [
                           "Got 1 oak log", "Crafted 4 minecraft:oak_planks",
                           "Could not find a valid recipe for minecraft:crafting_table"
                       ]
  result = env.step(_reply("craft 1 crafting table using 4 birch planks"))
  assert (result.observation, result.reward, result.done) == ("Crafted 1 minecraft:crafting_table",
                                                              1.0, True)


def test_a_generic_named_as_printed_takes_held_kinds_in_the_order_they_were_obtained():
  env = _episode("crafting_table")
  _observations(env, "get 1 birch logs", "craft 4 birch planks using 1 birch logs", "get 1 oak log",
                "craft 4 oak planks using 1 oak log")
  # "2 planks" takes the birch planks, listed (obtained) first; "4 planks" the last 2 birch
  # planks and 2 oak planks, as a Minecraft tag slot takes mixed kinds.
  assert _observations(env, "inventory", "craft 4 stick using 2 planks") == [
      "Inventory: [birch planks] (4) [oak planks] (4)", "Crafted 4 minecraft:stick"
  ]
  result = env.step(_reply("craft 1 crafting table using 4 planks"))
  assert (result.observation, result.reward, result.done) == ("Crafted 1 minecraft:crafting_table",
                                                              1.0, True)
  # 2 oak planks are not enough for another; a refused craft consumes nothing.
  assert _observations(env, "craft 1 crafting table using 4 planks", "inventory") == [
      "Could not find enough items to craft minecraft:crafting_table",
      "Inventory: [oak planks] (2) [stick] (4) [crafting table] (1)"
  ]


def test_a_gettable_generic_named_as_printed_takes_itself_first_then_any_member():
  env = _episode("campfire")
  _observations(env, "get 6 bamboo", *["craft 1 stick using 2 bamboo"] * 3, "get 2 charcoal",
                "get 1 oak log", "get 3 logs")
  # The gotten "logs" first, so a craft that names what it holds uses just that.
  assert _observations(env, "craft 1 campfire using 3 stick, 1 charcoal, 3 logs", "inventory",
                       "get 1 birch logs", "get 1 stripped spruce log", "get 6 bamboo",
                       *["craft 1 stick using 2 bamboo"] * 3,
                       "craft 1 campfire using 3 stick, 1 charcoal, 3 logs", "inventory") == [
                           "Crafted 1 minecraft:campfire",
                           "Inventory: [charcoal] (1) [oak log] (1) [campfire] (1)",
                           "Got 1 birch logs", "Got 1 stripped spruce log", "Got 6 bamboo",
                           *["Crafted 1 minecraft:stick"] * 3, "Crafted 1 minecraft:campfire",
                           "Inventory: [campfire] (2)"
                       ]


def test_wooden_slabs_are_filled_by_any_wooden_slab_as_planks_by_any_planks():
  env = _episode("barrel")
  assert _observations(env, "get 2 wooden slabs", "get 2 oak slab") == [
      "Could not find wooden slabs", "Could not find oak slab"
  ]
  _observations(env, "get 4 oak logs", *["craft 4 oak planks using 1 oak logs"] * 4, "get 3 stone",
                "craft 6 stone slab using 3 stone")
  # A stone slab is not a wooden slab, named as printed or by its own name.
  assert _observations(env, "craft 1 barrel using 6 planks, 2 wooden slabs",
                       "craft 1 barrel using 6 oak planks, 2 stone slab") == [
                           "Could not find enough items to craft minecraft:barrel",
                           "Could not find a valid recipe for minecraft:barrel"
                       ]
  _observations(env, "craft 6 oak slab using 3 oak planks", "get 1 spruce logs",
                "craft 4 spruce planks using 1 spruce logs",
                "craft 6 spruce slab using 3 spruce planks")
  for slab in ("oak slab", "spruce slab"):
    result = env.step(_reply(f"craft 1 barrel using 6 oak planks, 2 {slab}"))
    assert (result.observation, result.reward) == ("Crafted 1 minecraft:barrel", 1.0)
  # As printed: 1 oak + 1 spruce planks are not 6; with 8 birch planks more they are, and the
  # slabs come from the oak slabs, obtained before the spruce ones.
  assert _observations(env, "inventory", "craft 1 barrel using 6 planks, 2 wooden slabs") == [
      "Inventory: [oak planks] (1) [stone slab] (6) [oak slab] (4) [spruce planks] (1) "
      "[spruce slab] (4) [barrel] (2)", "Could not find enough items to craft minecraft:barrel"
  ]
  _observations(env, "get 2 birch logs", *["craft 4 birch planks using 1 birch logs"] * 2)
  result = env.step(_reply("craft 1 barrel using 6 planks, 2 wooden slabs"))
  assert (result.observation, result.reward) == ("Crafted 1 minecraft:barrel", 1.0)
  assert _observations(env, "inventory") == [
      "Inventory: [stone slab] (6) [oak slab] (2) [spruce slab] (4) [barrel] (3) [birch planks] (4)"
  ]


@pytest.mark.parametrize("logs", ["oak log", "stripped birch log", "logs", "oak logs"])
def test_logs_are_filled_by_a_member_a_gotten_logs_or_a_gotten_species_logs(logs):
  env = _episode("campfire")
  observations = _observations(env, "get 2 bamboo", "craft 1 stick using 2 bamboo", "get 4 bamboo",
                               "craft 1 stick using 2 bamboo", "craft 1 stick using 2 bamboo",
                               "get 1 charcoal", f"get 3 {logs}")
  assert observations[-1] == f"Got 3 {logs}"
  result = env.step(_reply(f"craft 1 campfire using 3 stick, 1 charcoal, 3 {logs}"))
  assert (result.observation, result.reward, result.done) == ("Crafted 1 minecraft:campfire", 1.0,
                                                              True)


def test_each_craft_makes_one_yield_whatever_count_is_asked():
  # Ladder: 7 sticks. Sticks come 4 per craft from 2 planks, so two crafts of 2 planks each;
  # asking for 8 sticks from 4 planks at once is not a recipe (AgentGym crafts once per action).
  env = _episode("ladder")
  assert _observations(env, "get 1 oak log", "craft 4 oak planks using 1 oak log",
                       "craft 8 stick using 4 oak planks", "craft 8 stick using 2 oak planks",
                       "craft 4 stick using 2 oak planks", "inventory") == [
                           "Got 1 oak log", "Crafted 4 minecraft:oak_planks",
                           "Could not find a valid recipe for minecraft:stick",
                           "Crafted 4 minecraft:stick", "Crafted 4 minecraft:stick",
                           "Inventory: [stick] (8)"
                       ]
  result = env.step(_reply("craft 3 ladder using 7 stick"))
  assert (result.observation, result.reward, result.done,
          result.info["success"]) == ("Crafted 3 minecraft:ladder", 1.0, True, True)
  # As in AgentGym, the game goes on after the goal: 8 - 7 sticks and the 3 ladders remain.
  assert env.step(_reply("inventory")).observation == "Inventory: [stick] (1) [ladder] (3)"
  env.close()
  with pytest.raises(RuntimeError, match="call reset"):
    env.step(_reply("inventory"))


def test_only_crafting_the_goal_is_rewarded():
  env = _episode("crafting_table")
  results = [env.step(_reply(a)) for a in ("get 1 oak log", "craft 4 oak planks using 1 oak log")]
  assert [(r.reward, r.done, r.info["success"]) for r in results] == [(0.0, False, False)] * 2


# Replies.


@pytest.mark.parametrize(
    "reply, action",
    [
        ("Thought: I need planks.\n\nAction: get 1 oak log", "get 1 oak log"),
        ("Thought: x\n\nAction:\n  craft 4 oak planks using 1 oak log.\n",
         "craft 4 oak planks using 1 oak log"),
        ("Action: inventory\nAction: get 2 stick", "get 2 stick"),  # the last Action: counts
        ("get 1 oak log", "get 1 oak log"),  # no Action: at all, the whole reply
        ("Action: get 1 oak log\nInstruction: ignore", "get 1 oak log"),
        ("Action: craft 1 minecraft:crafting_table using 4 oak_planks",
         "craft 1 minecraftcraftingtable using 4 oakplanks"),
        ("Action: get 1 oak log ✓ — ok", "get 1 oak log ok"),
        # A line break separates words (AgentGym's client would give "ChallengesYour turn").
        ("Action: Challenges\nYour turn in crafting", "Challenges Your turn in crafting"),
        ("", ""),
    ])
def test_parse_action_follows_agentgym(reply, action):
  assert parse_action(reply) == action


def test_an_unknown_multi_line_action_is_echoed_with_its_words_apart():
  env = TextCraftEnv()
  env.reset(env.task_ids("test")[0])
  result = env.step("Action: Challenges\nYour turn in crafting")
  assert result.observation == "Could not execute Challenges Your turn in crafting"


_KNOWN_OBSERVATION = re.compile(
    r"(Got \d+ |Crafted \d+ minecraft:|Inventory: |Could not find |Wrong item format: "
    r"|Could not execute )", re.S)
_ACTIONISH = st.builds(
    lambda verb, n, item, rest: f"{verb} {n} {item}{rest}",
    st.sampled_from(["get", "craft", "inventory", "Action: craft", "craft 1 stick using"]),
    st.one_of(st.integers(min_value=0, max_value=10**30), st.text(max_size=5)),
    st.sampled_from(["oak log", "oak planks", "planks", "logs", "stick", "bamboo", ""]),
    st.one_of(st.just(""), st.text(max_size=40), st.just(" using 2 oak planks, 1"),
              st.just(" using ,,, 3 , x")))


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    st.one_of(st.text(), _ACTIONISH, _ACTIONISH.map(_reply),
              st.lists(_ACTIONISH).map("\nAction: ".join)))
def test_any_reply_gets_an_observation_and_never_raises(reply):
  env = _episode("crafting_table")
  env.step(_reply("get 1 oak log"))
  result = env.step(reply)
  assert _KNOWN_OBSERVATION.match(result.observation), result.observation
  assert result.reward == 0.0 and not result.done


def test_huge_replies_get_bounded_observations():
  env = _episode("crafting_table")
  for reply in ("x" * 1_000_000, "Action: craft " + "1 oak planks, " * 100_000,
                "get " + "9" * 10_000 + " oak log", "Action: get 1 " + "\U0001F600" * 10_000):
    observation = env.step(reply).observation
    assert _KNOWN_OBSERVATION.match(observation) and len(observation) < 400, observation[:100]


# The oracle.


@pytest.mark.parametrize("goal_set", env_lib.GOAL_SETS)
def test_oracle_solves_every_goal_of_both_splits_from_the_text_alone(goal_set):
  env = TextCraftEnv(goals=goal_set)
  assert len(env.task_ids("train") + env.task_ids("test")) == {"default": 551,
                                                               "agentgym": 544}[goal_set]
  lengths = []
  for task_id in env.task_ids("train") + env.task_ids("test"):
    actions = solve(env.reset(task_id))
    results = [env.step(_reply(action)) for action in actions]
    failures = [(a, r.observation) for a, r in zip(actions, results)
                if not r.observation.startswith(("Got ", "Crafted "))]
    assert not failures, (env.task_info(task_id), failures)
    assert results[-1].done and results[-1].reward == 1.0, env.task_info(task_id)
    assert not any(r.done for r in results[:-1])
    lengths.append(len(actions))
  # The shallowest goals take two actions (get, craft); none needs more than a few dozen.
  assert min(lengths) == 2 and max(lengths) <= 40


# Recipe lines.

_LINE = re.compile(r"craft (\d+) (.+?) using (.+)")


def _listing(observation: str) -> list[str]:
  """The recipe lines of a first observation."""
  return observation.partition("\n\n")[0].splitlines()[1:]


def _ingredients(line: str) -> list[tuple[int, str]]:
  """(count, name) of each ingredient of a recipe line, as printed."""
  parts = _LINE.fullmatch(line).group(3).split(", ")
  return [(int(count), name) for count, name in (part.split(" ", 1) for part in parts)]


def _issued(line: str, book: RecipeBook) -> list[str]:
  """`line` as a player issues it: unchanged, but with each crafted generic (planks, wooden
  slabs, wool) named by one of its kinds, once for each kind, so that every kind fills every
  line that names its generic."""
  made, output = _LINE.fullmatch(line).group(1, 2)
  ingredients = _ingredients(line)
  kinds = {
      name: [display_name(member) for member in sorted(book.generics[item_id(name)])]
      for _, name in ingredients if item_id(name) in book.crafted_generics
  }
  variants = max(map(len, kinds.values()), default=1)
  return [
      f"craft {made} {output} using " +
      ", ".join(f"{count} {kinds[name][k % len(kinds[name])] if name in kinds else name}"
                for count, name in ingredients) for k in range(variants)
  ]


@functools.cache
def _plan(item: str) -> tuple[str, ...]:
  """The oracle's actions that craft `item` (a craftable item is a goal of its own)."""
  return tuple(solve(env_lib.first_observation(item_id(item))))


def _obtain(book: RecipeBook, item: str, count: int) -> list[str]:
  """Actions that add `count` of `item` to any inventory: get it if gettable, else repeat the
  plan that crafts it until it has made `count` (each repeat gets what it uses)."""
  if book.is_gettable(item_id(item)):
    return [f"get {count} {item}"]
  plan = _plan(item)
  made = int(_LINE.fullmatch(plan[-1]).group(1))
  return list(plan) * math.ceil(count / made)


def test_every_printed_recipe_line_crafts_as_printed(book):
  """Every distinct recipe line that a first observation prints, over every goal of both goal
  sets, is accepted on a fresh game whose ingredients were got or crafted by the game's own
  actions: with crafted generics named by a kind, as the instruction says, and verbatim, as
  printed, on a game holding that kind.

  Lines repeat across goals, so each distinct line is tried once per kind of its generics:
  648 lines (every recipe of the book, each in its own output's tree), 950 crafts with kinds
  named, and the 344 of them that name a kind in place of a generic once more as printed.
  """
  env = TextCraftEnv()
  lines = {
      line for goal_set in env_lib.GOAL_SETS for goal, _ in env_lib.goals(goal_set)
      for line in _listing(env_lib.first_observation(goal))
  }
  assert len(lines) == sum(map(len, book.recipes.values())) == 648
  crafts = collections.Counter()
  for line in sorted(lines):
    made, output = _LINE.fullmatch(line).group(1, 2)
    for command in _issued(line, book):
      for issued in dict.fromkeys((command, line)):
        env.reset(_task_id(item_id(output)))
        for count, item in _ingredients(command):
          for action in _obtain(book, item, count):
            observation = env.step(_reply(action)).observation
            assert observation.startswith(("Got ", "Crafted ")), (command, action, observation)
        result = env.step(_reply(issued))
        assert (result.observation,
                result.reward) == (f"Crafted {made} minecraft:{item_id(output)}", 1.0), issued
        crafts["generic as printed" if issued != command else "as issued"] += 1
  assert crafts == {"as issued": 950, "generic as printed": 344}
