"""Demonstrations: experts' conversations verified by replay, rollout filtering, JSONL files."""

import json
import re

import pytest

from agentgym_jax import demonstrations as demos_lib
from environments import base, jsonl
from environments.babyai import actions as babyai_actions
from environments.babyai import expert as babyai_expert
from environments.sciworld import expert as sciworld_expert
from environments.textcraft import expert as textcraft_expert
from environments.textcraft import oracle, parse_action
from env_helpers import env_fixture, run_python

_REPLY = re.compile(r"Thought: [^\n]+\n\nAction: [^\n]+")

textcraft = env_fixture("textcraft")
babyai = env_fixture("babyai")
babyai_tools = env_fixture("babyai", action_format="tool_call")


def _replies(record):
  return [m["content"] for m in record["messages"] if m["role"] == "assistant"]


# --- TextCraft -----------------------------------------------------------------------------


def test_oracle_demos_of_every_train_goal_up_to_depth_2_succeed_on_replay(textcraft):
  task_ids = [t for t in textcraft.task_ids("train") if textcraft.task_info(t)["depth"] <= 2]
  assert len(task_ids) == 352  # 113 goals of depth 1 and 239 of depth 2 in the train split
  result = demos_lib.demonstrate_tasks(textcraft, task_ids)
  assert result.rejected == []
  assert [d["task_id"] for d in result.demos] == task_ids
  for demo in result.demos:
    assert set(demo) == {
        "task_id", "env", "category", "source", "reward", "success", "num_turns", "messages"
    }
    assert (demo["env"], demo["source"]) == ("textcraft", "textcraft_oracle")
    assert demo["success"] and demo["reward"] == 1.0
    assert demo["category"] == textcraft.task_info(demo["task_id"])["category"]
    # The rollout's layout: the first user turn, then reply / observation alternating, ending
    # with the winning reply (its observation is not part of the conversation).
    roles = [m["role"] for m in demo["messages"]]
    assert roles == ["user"] + ["assistant", "user"] * (demo["num_turns"] - 1) + ["assistant"]
    first = textcraft.reset(demo["task_id"])
    assert demo["messages"][0]["content"] == f"{textcraft.instruction}\n\n{first}"
    replies = _replies(demo)
    assert all(_REPLY.fullmatch(r) for r in replies)
    assert [parse_action(r) for r in replies] == oracle.solve(first)


def test_textcraft_thoughts_say_what_each_action_is_for():
  plan = [
      "get 2 oak logs", "craft 4 oak planks using 1 oak logs",
      "craft 4 oak planks using 1 oak logs", "craft 1 chest using 8 oak planks"
  ]
  # The chest takes 8 oak planks = 2 crafts of 4, which take 2 x 1 oak logs.
  assert [textcraft_expert.thought(plan, i, "chest") for i in range(4)] == [
      "To craft the oak planks I need 2 oak logs, which I can get directly, so I get 2.",
      "To craft the chest I need 8 oak planks, which I craft from oak logs.",
      "I have 4 of the 8 oak planks for the chest, so I craft again.",
      "I have everything for the chest, so I craft it to reach the goal."
  ]


def test_replay_rejects_replies_that_do_not_finish_or_fail(textcraft):
  task_id = textcraft.task_ids("train")[0]
  replies = textcraft_expert.replies(textcraft, task_id)
  record, reason = demos_lib.replay(textcraft, task_id, replies[:-1], source="test")
  assert reason == f"not done after {len(replies) - 1} replies"
  assert not record["success"] and record["reward"] == 0.0
  record, reason = demos_lib.demonstrate(textcraft, task_id, lambda *_: [], "test")
  assert (record, reason) == (None, "no replies")
  # Replies after the winning one are dropped: the conversation ends with the winning reply.
  record, reason = demos_lib.replay(textcraft, task_id, replies + ["Action: inventory"],
                                    source="test")
  assert reason == "" and _replies(record) == replies


def test_demonstrations_are_deterministic(textcraft, babyai):
  for env, task_ids in ((textcraft, textcraft.task_ids("train")[:20]), (babyai, [92, 121])):
    assert demos_lib.demonstrate_tasks(env, task_ids) == demos_lib.demonstrate_tasks(env, task_ids)


# --- BabyAI --------------------------------------------------------------------------------

# Train tasks; task t is level t % 40 with seed t // 40: GoToObjDoor, OpenRedDoor, OpenDoorLoc,
# PickupDistDebug, PutNextLocalS6N4, Unlock, ActionObjDoor, GoToRedBall, GoToSeqS5R2.
_BABYAI_TASKS = [90, 92, 93, 99, 101, 103, 109, 121, 127]


def test_bot_demos_solve_babyai_tasks_on_replay(babyai):
  result = demos_lib.demonstrate_tasks(babyai, _BABYAI_TASKS)
  assert result.rejected == []
  for demo in result.demos:
    assert demo["success"] and 0 < demo["reward"] <= 1
    assert demo["source"] == "babyai_bot"
    replies = _replies(demo)
    assert all(_REPLY.fullmatch(r) for r in replies)
    # Every action is in the adapter's grammar.
    assert all(babyai_actions.parse(babyai_actions.extract_action(r)) for r in replies)
    assert replies[0].startswith("Thought: My mission is to ")


def test_high_level_demos_are_shorter_and_score_at_least_as_well(babyai):
  # Task 121 (GoToRedBall): the bot walks 14 primitive steps; "go to red ball 1" once it sees
  # the ball replaces the walk.
  primitive, reason = demos_lib.demonstrate(
      babyai, 121, lambda env, t: babyai_expert.replies(env, t, high_level=False), "bot")
  assert reason == ""
  high_level, reason = demos_lib.demonstrate(babyai, 121, babyai_expert.replies, "bot")
  assert reason == ""
  assert primitive["num_turns"] == 14
  assert high_level["num_turns"] < primitive["num_turns"]
  assert high_level["reward"] >= primitive["reward"]
  assert any(babyai_actions.extract_action(r).startswith("go to ") for r in _replies(high_level))


def test_tasks_the_bot_cannot_solve_are_rejected_with_the_reason(babyai):
  # Task 105 is KeyInBox (level 25, seed 2), which BabyAIBot does not solve.
  result = demos_lib.demonstrate_tasks(babyai, [105, 92])
  assert [d["task_id"] for d in result.demos] == [92]
  assert len(result.rejected) == 1 and result.rejected[0][0] == 105
  assert result.rejected[0][1].startswith("expert failed: BabyAIBot failed")
  assert "rejected 1: expert failed" in result.summary()


# --- SciWorld ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("action_format", base.ACTION_FORMATS)
def test_sciworld_gold_demos_succeed_on_replay(action_format):
  try:
    demos_lib.expert_for("sciworld")
  except ValueError as error:
    pytest.skip(str(error))
  with base.make("sciworld", action_format=action_format) as env:
    task_id = env.task_ids("train")[0]  # boil, variation 0: "examine" and "pour" as tool calls
    result = demos_lib.demonstrate_tasks(env, [task_id])
  assert result.rejected == []
  (demo,) = result.demos
  assert demo["success"] and demo["reward"] == pytest.approx(1.0)
  if action_format == "tool_call":
    assert {"look_at", "focus_on"} <= {name for name, _ in _tool_calls(demo)}
  else:
    assert all(_REPLY.fullmatch(r) for r in _replies(demo))


def test_sciworld_thoughts_follow_the_verb():
  assert sciworld_expert.thought("move metal pot to sink") == "I move the metal pot to the sink."
  assert sciworld_expert.thought("focus on substance in metal pot") == (
      "The task is about the substance in the metal pot, so I focus on it.")
  assert sciworld_expert.thought("0") == "Several things match my action; I choose option 0."


# --- rollouts and files --------------------------------------------------------------------


def _rollout(task_id, replies, *, reward, success, messages=None):
  """A record shaped like Trajectory.to_json (messages only need the replies here)."""
  if messages is None:
    messages = [{"role": "user", "content": "stale prompt"}]
    for i, text in enumerate(replies):
      messages += [{"role": "assistant", "content": text}]
      if i + 1 < len(replies):
        messages += [{"role": "user", "content": "stale observation"}]
  return {
      "task_id": task_id, "group": 0, "reward": reward, "success": success,
      "num_turns": len(replies), "termination": "done", "messages": messages
  }


def test_from_rollouts_filters_dedupes_and_replays(textcraft):
  a, b = textcraft.task_ids("train")[:2]
  good_a = textcraft_expert.replies(textcraft, a)
  good_b = textcraft_expert.replies(textcraft, b)
  records = [
      _rollout(a, good_a, reward=1.0, success=True),
      _rollout(a, good_a, reward=1.0, success=True),  # the same replies again: kept once
      _rollout(b, good_b[:1], reward=0.0, success=False),  # below min_reward: skipped
      _rollout(b, ["Action: get 1 dirt"], reward=1.0, success=True),  # claims success; fails
      _rollout(b, good_b, reward=1.0, success=True)
  ]
  result = demos_lib.from_rollouts(records, textcraft, min_reward=1.0)
  assert [d["task_id"] for d in result.demos] == [a, b]
  assert result.rejected == [(b, "not done after 1 reply")]
  for demo, replies in zip(result.demos, (good_a, good_b)):
    assert demo["source"] == "rollout" and _replies(demo) == replies
    # Rebuilt from the replay: the env's prompt and observations, not the logged ones.
    assert demo["messages"][0]["content"].startswith(textcraft.instruction)
    assert "stale observation" not in json.dumps(demo)


class _ProgressEnv:
  """Each reply "Action: +x" earns reward x; "Action: finish" ends the episode in success."""

  name = "progress"
  instruction = "Make progress."

  def task_ids(self, split):
    return (0,)

  def task_info(self, task_id):
    return {"category": "all"}

  def reset(self, task_id):
    return "Start."

  def step(self, action_text):
    action = action_text.rpartition("Action: ")[2]
    if action == "finish":
      return base.StepResult("Finished.", 0.0, True, {"success": True})
    return base.StepResult("Noted.", float(action), False, {"success": False})

  def close(self):
    pass


def test_from_rollouts_keeps_partial_progress_when_success_is_not_required():
  env = _ProgressEnv()
  partial = _rollout(0, ["Action: 0.4", "Action: 0.2"], reward=0.6, success=False)
  little = _rollout(0, ["Action: 0.1"], reward=0.1, success=False)
  result = demos_lib.from_rollouts([partial, little], env, min_reward=0.5, require_success=False)
  assert [d["reward"] for d in result.demos] == [pytest.approx(0.6)]
  assert not result.demos[0]["success"] and result.rejected == []
  # A logged reward the replay does not reproduce is rejected.
  inflated = _rollout(0, ["Action: 0.3"], reward=0.9, success=False)
  result = demos_lib.from_rollouts([inflated], env, min_reward=0.5, require_success=False)
  assert result.rejected == [(0, "replay earned less than min_reward 0.5")]
  # 0.7 + 0.2 + 0.1 sums to 0.9999999999999999 in floating point: still a full reward.
  full = _rollout(0, ["Action: 0.7", "Action: 0.2", "Action: 0.1", "Action: finish"],
                  reward=0.7 + 0.2 + 0.1, success=True)
  result = demos_lib.from_rollouts([full], env, min_reward=1.0)
  assert len(result.demos) == 1 and result.demos[0]["success"]


def test_from_rollouts_rejects_records_without_messages(textcraft):
  with pytest.raises(ValueError, match="record 0 lacks task_id"):
    demos_lib.from_rollouts([{"task_id": 1, "reward": 1.0}], textcraft)


def test_jsonl_round_trip_and_bad_lines(tmp_path, textcraft):
  demos = demos_lib.demonstrate_tasks(textcraft, textcraft.task_ids("train")[:3]).demos
  path = tmp_path / "sub" / "demos.jsonl"
  assert jsonl.write(path, demos) == 3
  assert jsonl.read(path) == demos
  assert not (tmp_path / "sub" / "demos.jsonl.tmp").exists()
  path.write_text(path.read_text() + "\n{not json\n")
  with pytest.raises(ValueError, match=r"demos.jsonl:5 is not valid JSON"):
    jsonl.read(path)


def test_make_demos_writes_verified_textcraft_demos(tmp_path, textcraft):
  out = tmp_path / "demos.jsonl"
  run_python("launch/make_demos.py", "--env=textcraft", "--split=train", f"--out={out}",
             "--max_depth=1", "--limit=5")
  demos = jsonl.read(out)
  assert len(demos) == 5
  assert all(d["success"] and d["category"] == "depth1" for d in demos)
  assert all(d["task_id"] in textcraft.task_ids("train") for d in demos)


# --- The tool_call action format -----------------------------------------------------------

_TOOL_CALL_REPLY = re.compile(r"[^\n]+\n\n<tool_call>\n(\{[^\n]+\})\n</tool_call>")


def _tool_calls(record):
  """(name, arguments) of every reply, each a thought and one tool call."""
  calls = []
  for reply in _replies(record):
    match = _TOOL_CALL_REPLY.fullmatch(reply)
    assert match, reply
    call = json.loads(match.group(1))
    calls.append((call["name"], call["arguments"]))
  return calls


def test_oracle_demos_succeed_in_the_tool_call_format(textcraft):
  tool_env = base.make("textcraft", action_format="tool_call")
  task_ids = list(tool_env.task_ids("test"))
  result = demos_lib.demonstrate_tasks(tool_env, task_ids)
  assert result.rejected == [] and len(result.demos) == 100
  react = demos_lib.demonstrate_tasks(textcraft, task_ids[:10]).demos
  for demo, react_demo in zip(result.demos, react):
    assert demo["tools"] == base.tools_of(tool_env) and len(demo["tools"]) == 3
    assert demo["messages"][0]["content"].startswith(tool_env.instruction)
    # The same actions as the ReAct demonstration, as calls of get and craft, with the same
    # observations.
    actions = [parse_action(r) for r in _replies(react_demo)]
    calls = _tool_calls(demo)
    assert [tool_env.action_format.tools[name].action_text(arguments) for name, arguments in calls
           ] == actions
    assert {name for name, _ in calls} <= {"get", "craft"}
    observations = [m["content"] for m in demo["messages"][2::2]]
    assert observations == [m["content"] for m in react_demo["messages"][2::2]]


@pytest.mark.parametrize("action_format", base.ACTION_FORMATS)
def test_searchqa_expert_answers_every_test_question(action_format):
  env = base.make("searchqa", action_format=action_format)
  result = demos_lib.demonstrate_tasks(env, env.task_ids("test"))
  assert result.rejected == [] and len(result.demos) == 256
  for demo in result.demos:
    assert demo["source"] == "searchqa_hops" and demo["success"] and demo["reward"] == 1.0
    # 2-3 hops over 1-3 pages, then the answer.
    assert 2 <= demo["num_turns"] <= 4
    if action_format == "tool_call":
      calls = _tool_calls(demo)
      assert [name for name, _ in calls] == ["search"] * (len(calls) - 1) + ["answer"]
      assert calls[-1][1] == {"answer": env.task_info(demo["task_id"])["golden_answers"][0]}
    else:
      assert all(r.startswith("<think>") for r in _replies(demo))
      assert "tools" not in demo


def test_searchqa_has_no_expert_for_questions_without_hops():

  class Flashrag:
    name = "searchqa"

    def task_info(self, task_id):
      return {"category": "NQ", "question": "Who?", "golden_answers": ["Me"]}

  with pytest.raises(base.ExpertError, match="no hops"):
    demos_lib.EXPERTS["searchqa"][1](Flashrag(), 0)


def test_bot_demos_succeed_in_the_tool_call_format(babyai_tools):
  result = demos_lib.demonstrate_tasks(babyai_tools, _BABYAI_TASKS[:4])
  assert result.rejected == []
  for demo in result.demos:
    calls = _tool_calls(demo)
    assert {name for name, _ in calls} <= set(babyai_tools.action_format.tools)
    assert _replies(demo)[0].startswith("My mission is to ")
