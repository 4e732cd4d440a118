"""SciWorld adapter: task ids and splits, gold episodes, rewards, invalid replies, the JVM's life.

One adapter (one JVM) serves the module; tests that need a JVM of their own say why.
"""

import json
import threading

import psutil
import pytest
import scienceworld

from environments import base
from environments.sciworld import INVALID_ACTION, SciWorldEnv, parse_action
from environments.sciworld import env as env_lib
from environments.sciworld import tasks as tasks_lib
from env_helpers import env_fixture, react_reply, run_python

FIND_ANIMAL = 14  # index of find-animal in TASKS; its gold path is short and physics-free
# Test-split tasks whose gold paths are short (7-16 actions) and quick to generate.
QUICK_GOLD_TASKS = ("power-component", "find-animal", "chemistry-mix-paint-secondary-color")

env = env_fixture("sciworld")
# The package's own Python environment, the reference our steps must agree with.
package_env = env_fixture(scienceworld.ScienceWorldEnv)


@pytest.fixture(scope="module")
def find_animal_gold(env):
  """The gold actions of find-animal variation 225: doors and rooms, the animal, the box."""
  return env.gold_actions(tasks_lib.task_id(FIND_ANIMAL, 225))


def _first_test_id(task_name: str) -> int:
  return next(
      i for i in tasks_lib.split_ids("test") if tasks_lib.task_info(i)["category"] == task_name)


def _java_children() -> set[int]:
  """Process ids of the live `java` processes this test process started."""
  return {
      p.pid for p in psutil.Process().children(recursive=True)
      if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.name() == "java"
  }


def _lines(observation: str) -> list[str]:
  """The lines of an observation, sorted: the simulator lists a room's objects in an order
  that can change from one load to the next (its objects live in Scala sets)."""
  return sorted(observation.splitlines())


# Task ids and splits (no JVM).


def test_task_ids_name_task_index_and_variation():
  # 140225 = 10_000 * 14 + 225: find-animal (paper task 4-4), variation 225, its first test one.
  assert tasks_lib.task_info(140225) == {
      "category": "find-animal", "task": "4-4", "variation": 225, "split": "test"
  }
  assert tasks_lib.task_info(0)["category"] == "boil"
  assert tasks_lib.task_info(290479) == {  # the last variation of the last task
      "category": "mendelian-genetics-unknown-plant", "task": "10-2", "variation": 479,
      "split": "test"
  }
  for bad in (-1, 300_000, 30, 140300, 1.5, True, "21"):  # boil has 30, find-animal 300
    with pytest.raises(ValueError):
      tasks_lib.lookup(bad)


def test_split_sizes_and_test_spread(env):
  train, test = env.task_ids("train"), env.task_ids("test")
  # Train: every train variation, 14 * 4 + 270 + 218 + ... = sum of dev_start over TASKS.
  assert len(train) == sum(task.dev_start for task in tasks_lib.TASKS) == 3592
  assert len(test) == tasks_lib.TEST_SIZE == 200
  assert not set(train) & set(test)
  assert all(env.task_info(i)["split"] == "train" for i in train)
  assert all(env.task_info(i)["split"] == "test" for i in test)
  per_task = {}
  for i in test:
    per_task.setdefault(env.task_info(i)["category"], []).append(env.task_info(i)["variation"])
  assert set(per_task) == {task.name for task in tasks_lib.TASKS}
  # Round-robin deal of 200 over 30 tasks: four full rounds (120), round 5 skips
  # identify-life-stages-2 (4 test variations: 149), round 6 also skips the three tasks with 5
  # (175), round 7 deals the last 25 to the first 25 of the 26 tasks left, in TASKS order.
  counts = sorted(len(v) for v in per_task.values())
  assert counts == [4] + [5] * 3 + [6] + [7] * 25
  assert len(per_task["mendelian-genetics-unknown-plant"]) == 6  # last in TASKS order
  # boil: 7 of its 9 test variations 21..29, the middle of each of 7 strata:
  # 21 + floor((2i + 1) * 9 / 14) for i < 7 = 21 + (0, 1, 3, 4, 5, 7, 8).
  assert per_task["boil"] == [21, 22, 24, 25, 26, 28, 29]


def test_task_ids_are_the_same_in_another_process_and_hash_seed(env):
  code = ("import json; from environments.sciworld import tasks; "
          "print(json.dumps([tasks.split_ids('train'), tasks.split_ids('test')]))")
  train, test = json.loads(run_python("-c", code, hash_seed="123"))
  assert tuple(train) == tuple(env.task_ids("train"))
  assert tuple(test) == tuple(env.task_ids("test"))
  with pytest.raises(ValueError):
    env.task_ids("dev")


def test_variation_counts_match_package(package_env):
  assert [task.name for task in tasks_lib.TASKS
         ] == [task["task_name"] for task in scienceworld.constants.TASKS]
  assert sorted(task.name for task in tasks_lib.TASKS) == sorted(package_env.get_task_names())
  for task in tasks_lib.TASKS:
    assert package_env.get_max_variations(task.name) == task.num_variations, task.name


def _check_variation_split(package_env, task):
  package_env.load(task.name, 0)
  assert package_env.get_variations_train() == list(task.variations("train")), task.name
  assert package_env.get_variations_dev() == list(task.variations("dev")), task.name
  assert package_env.get_variations_test() == list(task.variations("test")), task.name


@pytest.mark.parametrize(
    "task_name", ["boil", "identify-life-stages-2", "inclined-plane-friction-named-surfaces"])
def test_variation_split_matches_package(package_env, task_name):
  # Three shapes of split: 30 = 14 + 7 + 9, 10 = 4 + 2 + 4, 1386 = 692 + 346 + 348.
  _check_variation_split(package_env, next(t for t in tasks_lib.TASKS if t.name == task_name))


@pytest.mark.slow
def test_variation_split_of_every_task_matches_package(package_env):
  for task in tasks_lib.TASKS:  # loads all 30 tasks, ~30 s
    _check_variation_split(package_env, task)


# Replies and the instruction.


def test_parse_action_reads_first_line_after_first_marker():
  assert parse_action("Thought: open it.\n\nAction: open door to kitchen") == (
      "open door to kitchen")
  assert parse_action("Thought: x\n\nAction:\n  go to hallway \nObservation: ...") == (
      "go to hallway")
  assert parse_action("action: look around\nAction: wait") == "look around"
  assert parse_action("Thought: no action here") is None
  assert parse_action("Thought: x\n\nAction:   \n\n") is None


def test_instruction_lists_every_simulator_verb(env, package_env):
  package_env.load("boil", 0)
  # The simulator's templates, e.g. "go OBJ", "pour OBJ in OBJ"; "reset task" is withheld.
  simulator_verbs = {template.split()[0] for template in package_env.get_possible_actions()}
  instruction_verbs = {
      part.split()[0] for template, _ in env_lib.ACTIONS for part in template.split(" / ")
  }
  assert instruction_verbs == simulator_verbs - {"reset"}
  for template, _ in env_lib.ACTIONS:
    assert f"- {template}: " in env.instruction
  assert env.instruction.endswith("Thought: <your reasoning>\n\nAction: <one action>")


# Episodes.


@pytest.mark.parametrize("task_name", QUICK_GOLD_TASKS)
def test_gold_actions_reach_full_score(env, task_name):
  task_id = _first_test_id(task_name)
  gold = env.gold_actions(task_id)
  first = env.reset(task_id)
  assert first.startswith("Your task is to ")
  rewards, result = [], None
  for action in gold:
    result = env.step(react_reply(action))
    rewards.append(result.reward)
    assert result.info["action"] == action
    if result.done:
      break
  assert result.done and result.info["success"] and result.info["score"] == 100
  assert all(r >= 0 for r in rewards)
  assert sum(rewards) == pytest.approx(1.0)
  with pytest.raises(RuntimeError, match="reset"):
    env.step(react_reply("look around"))


def test_steps_agree_with_package_and_failure_takes_back_progress(env, package_env,
                                                                  find_animal_gold):
  task_id = tasks_lib.task_id(FIND_ANIMAL, 225)
  # Open and walk (score 8, 17), an unknown verb, then focus on the agent, not an animal: the
  # simulator fails the task with score -100 and the rewards give back the 17 points.
  actions = find_animal_gold[:2] + ["dance around", "look at picture", "focus on agent"]
  env.reset(task_id)
  package_env.load("find-animal", 225)
  package_env.step("look around")
  rewards = []
  for action in actions:
    ours = env.step(react_reply(action))
    observation, _, done, info = package_env.step(action)
    assert _lines(ours.observation) == _lines(observation), action
    assert (ours.info["score"], ours.done) == (info["score"], done), action
    rewards.append(ours.reward)
  assert [env_lib.FULL_SCORE * r for r in rewards] == pytest.approx([8, 9, 0, 0, -17])
  assert ours.done and ours.info["score"] == -100 and not ours.info["success"]
  assert sum(rewards) == pytest.approx(0.0)  # max(-100, 0) / 100


def test_partial_progress_sums_to_score(env, find_animal_gold):
  env.reset(tasks_lib.task_id(FIND_ANIMAL, 225))
  total = sum(env.step(react_reply(action)).reward for action in find_animal_gold[:9])
  # Doors and rooms (17), focus on the animal (+50), pick it up (+8): 75 of 100.
  assert env.step(react_reply("look around")).info["score"] == 75
  assert total == pytest.approx(0.75)


def test_invalid_replies_get_the_simulators_error(env, package_env):
  # The package's answer to an unknown action, so that the two texts cannot drift apart.
  package_env.load("find-animal", 225)
  assert package_env.step("jump over the moon")[0] == INVALID_ACTION
  env.reset(tasks_lib.task_id(FIND_ANIMAL, 225))
  unknown = env.step(react_reply("jump over the moon"))
  assert (unknown.observation, unknown.reward, unknown.done) == (INVALID_ACTION, 0.0, False)
  for reply in ("I will open the door.", "Thought: hmm\n\nAction:", ""):
    result = env.step(reply)
    assert (result.observation, result.reward, result.done) == (INVALID_ACTION, 0.0, False)
    assert result.info == {"score": 0, "success": False, "action": None}
  opened = env.step(react_reply("open door to hallway"))
  assert opened.observation == "The door is now open." and opened.info["score"] == 8


def test_ambiguous_action_offers_numbered_choices(env):
  # From the hallway, "door" names six doors; the agent answers with a number.
  env.reset(tasks_lib.task_id(FIND_ANIMAL, 225))
  env.step(react_reply("open door to hallway"))
  env.step(react_reply("go to hallway"))
  choices = env.step(react_reply("look at door"))
  assert choices.observation.startswith("Ambiguous request: Please enter the number")
  assert not choices.done
  chosen = env.step(react_reply("0"))
  assert chosen.observation.startswith("A door to the ")


def test_reset_rewinds_the_same_world(env):
  task_id = tasks_lib.task_id(FIND_ANIMAL, 225)
  first = env.reset(task_id)
  env.step(react_reply("open door to hallway"))
  env.step(react_reply("go to hallway"))
  again = env.reset(task_id)  # the same task: rewound, not reloaded
  assert _lines(again) == _lines(first)
  assert env.step(react_reply("look around")).info["score"] == 0
  other = env.reset(tasks_lib.task_id(FIND_ANIMAL, 226))
  assert other != first
  assert _lines(env.reset(task_id)) == _lines(first)


def test_many_resets_reuse_one_jvm(env):
  env.reset(0)
  pid, threads = env.jvm_pid, threading.active_count()
  for task_id in tasks_lib.split_ids("test")[::10]:  # 20 resets over 20 different tasks
    env.reset(task_id)
    env.step(react_reply("look around"))
  assert env.jvm_pid == pid
  assert pid in _java_children()
  assert threading.active_count() == threads


def test_step_limit_ends_the_episode(env):
  env.step_limit = 2
  try:
    env.reset(tasks_lib.task_id(FIND_ANIMAL, 225))
    # Moves 1 and 2 are within the limit; the package ends the episode once moves > limit.
    assert not env.step(react_reply("open door to hallway")).done
    assert not env.step(react_reply("go to hallway")).done
    assert not env.step(react_reply("look around")).done  # looking is not a move
    assert env.step(react_reply("open door to kitchen")).done
  finally:
    env.step_limit = env_lib.DEFAULT_STEP_LIMIT


# The JVM's life.


def test_close_stops_the_jvm_and_its_threads():  # starts a JVM of its own, ~2 s
  threads_before = threading.active_count()
  java_before = _java_children()
  adapter = SciWorldEnv()
  assert adapter.jvm_pid is None  # no JVM until the first reset
  adapter.reset(0)
  pid = adapter.jvm_pid
  assert _java_children() - java_before == {pid}
  assert threading.active_count() > threads_before  # py4j's readers of the JVM's output
  adapter.close()
  adapter.close()  # idempotent
  assert _java_children() == java_before
  assert threading.active_count() == threads_before
  with pytest.raises(RuntimeError, match="closed"):
    adapter.reset(0)


def test_the_jvm_keeps_its_memory_over_many_episodes():  # a JVM of its own, ~15 s
  """With Java's default heap the JVM grew ~20 MB per episode (past 1 GB within 50 episodes);
  with ours it stays near its start-up size, the heap given back after collections."""
  with SciWorldEnv(jvm_heap_mb=256) as adapter:
    adapter.reset(0)
    jvm = psutil.Process(adapter.jvm_pid)
    assert "-Xmx256m" in jvm.cmdline() and "-XX:+UseSerialGC" in jvm.cmdline()
    task_ids = tasks_lib.split_ids("train")
    rss_mb = []
    for episode in range(60):
      adapter.reset(task_ids[(37 * episode) % len(task_ids)])  # a new world each time
      for action in ("look around", "open door to hallway", "go to hallway", "inventory"):
        adapter.step(react_reply(action))
      rss_mb.append(jvm.memory_info().rss / 2**20)
  assert max(rss_mb) < 256, rss_mb
  # After start-up it grows only with the JIT's compiled code, 0.3-0.6 MB an episode until
  # ~70 episodes and then flat (measured over 100); the default heap's leak was ~20 MB an episode.
  assert (rss_mb[-1] - rss_mb[9]) / 50 < 1.0, rss_mb


def test_jvm_heap_must_be_an_int_of_at_least_64_mb():
  for bad in (32, 256.0, True, "512"):
    with pytest.raises(ValueError, match="jvm_heap_mb"):
      SciWorldEnv(jvm_heap_mb=bad)


@pytest.mark.slow
def test_gold_actions_solve_every_task():
  """The package's gold path for the first test variation of each of the 30 tasks, replayed
  through step(), reaches 100 (several need more than 100 moves, hence the limit; minutes)."""
  with SciWorldEnv(step_limit=1000) as adapter:
    for task in tasks_lib.TASKS:
      task_id = _first_test_id(task.name)
      gold = adapter.gold_actions(task_id)
      adapter.reset(task_id)
      total, result = 0.0, None
      for action in gold:
        result = adapter.step(react_reply(action))
        total += result.reward
        if result.done:
          break
      assert result.info["success"], (task.name, result.info)
      assert total == pytest.approx(1.0), task.name


def test_tool_calls_reach_the_simulator_as_their_actions(find_animal_gold):
  with SciWorldEnv(action_format="tool_call") as adapter:
    adapter.reset(tasks_lib.task_id(FIND_ANIMAL, 225))
    assert base.TOOL_CALL_INSTRUCTION in adapter.instruction
    bad = adapter.step(base.tool_call_reply("Hm.", "look_at", {}))
    assert bad.observation.startswith("Invalid tool call: look_at needs the argument 'object'")
    assert (bad.reward, bad.done, bad.info["score"]) == (0.0, False, 0)
    total = sum(
        adapter.step(base.reply_for(adapter, "On.", action)).reward
        for action in find_animal_gold[:9])
  with SciWorldEnv() as react:
    react.reset(tasks_lib.task_id(FIND_ANIMAL, 225))
    assert total == sum(react.step(react_reply(action)).reward for action in find_animal_gold[:9])
  assert total > 0
