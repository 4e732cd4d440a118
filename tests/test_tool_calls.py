"""Tool-call actions (environments/base.py): schemas, calls to action text and back, and every
bad call answered with an observation, never an exception; each environment's tools."""

import contextlib
import json

import hypothesis
import pytest
from hypothesis import strategies as st

from environments import base
from environments.babyai import env as babyai_env
from environments.searchqa import env as searchqa_env
from environments.sciworld import env as sciworld_env
from environments.textcraft import env as textcraft_env
from environments.webarena import env as webarena_env

CRAFT = textcraft_env.TOOLS[1]
TEXTCRAFT = base.ActionFormat("tool_call", textcraft_env.TOOLS)
TYPE = webarena_env.TOOLS[1]


def _call(name, arguments, thought="Thinking."):
  return base.tool_call_reply(thought, name, arguments)


def _replies(names, keys, values):
  """Any text, or a call of one of the tools `names` with up to 3 arguments of `keys`."""
  return st.text(max_size=200) | st.builds(
      _call, st.sampled_from(names), st.dictionaries(st.sampled_from(keys), values, max_size=3))


def test_a_tool_is_an_openai_style_function_schema():
  assert CRAFT.schema() == {
      "type": "function", "function": {
          "name": "craft", "description": CRAFT.description, "parameters": {
              "type": "object", "properties": {
                  "count": {
                      "type": "integer", "description": "How many targets the command makes."
                  },
                  "target": {"type": "string", "description": 'The item to craft, e.g. "stick".'},
                  "ingredients": {
                      "type": "array", "items": {"type": "string"},
                      "description": 'Each ingredient with its count, as the command lists '
                                     'it, e.g. ["2 oak planks"].'
                  }
              }, "required": ["count", "target", "ingredients"]
          }
      }
  }
  enter = TYPE.schema()["function"]["parameters"]
  assert enter["required"] == ["element_id", "text"]
  assert enter["properties"]["press_enter_after"]["enum"] == [0, 1]


def test_a_call_spells_the_environment_action():
  assert CRAFT.action_text({"count": 4, "target": "stick", "ingredients": ["2 oak planks"]
                           }) == ("craft 4 stick using 2 oak planks")
  assert CRAFT.action_text(
      {"target": "bed", "count": 1,
       "ingredients": ["3 white wool", "3 planks"]}) == ("craft 1 bed using 3 white wool, 3 planks")
  # An optional argument left out takes its attached text with it.
  assert TYPE.action_text({"element_id": 3, "text": "kettle"}) == "type [3] [kettle]"
  assert TYPE.action_text({"element_id": 3, "text": "k",
                           "press_enter_after": 0}) == ("type [3] [k] [0]")
  pick_up = babyai_env.TOOLS[4]
  assert (pick_up.action_text({}), pick_up.action_text({"object": "red ball 1"
                                                       })) == ("pick up", "pick up red ball 1")
  # Argument values are never read as placeholders.
  assert textcraft_env.TOOLS[0].action_text({"count": 1, "item": "{count}"}) == "get 1 {count}"


@pytest.mark.parametrize("tools,action,name", [
    (textcraft_env.TOOLS, "get 2 oak logs", "get"),
    (textcraft_env.TOOLS, "craft 4 oak planks using 1 oak logs", "craft"),
    (textcraft_env.TOOLS, "craft 1 bed using 3 white wool, 3 planks", "craft"),
    (textcraft_env.TOOLS, "inventory", "inventory"),
    (searchqa_env.TOOLS, "<search> Orange Wool </search>", "search"),
    (searchqa_env.TOOLS, "<answer> 42 </answer>", "answer"),
    (babyai_env.TOOLS, "toggle and go through blue door 1", "toggle_and_go_through"),
    (babyai_env.TOOLS, "toggle", "toggle"),
    (babyai_env.TOOLS, "pick up", "pick_up"),
    (babyai_env.TOOLS, "pick up grey key 2", "pick_up"),
    (sciworld_env.TOOLS, "use thermometer in inventory on substance in metal pot", "use_on"),
    (sciworld_env.TOOLS, "use stove", "use"),
    (sciworld_env.TOOLS, "open door to kitchen", "open"),
    (sciworld_env.TOOLS, "look around", "look_around"),
    (sciworld_env.TOOLS, "pour jug into flower pot 1", "pour"),
    (sciworld_env.TOOLS, "0", "choose"),
    (webarena_env.TOOLS, "stop []", "stop"),
    (webarena_env.TOOLS, "type [12] [blue kettle] [0]", "type"),
    (webarena_env.TOOLS, "goto [http://127.0.0.1:7770/a?b=1]", "goto"),
])
def test_actions_go_to_tool_calls_and_back(tools, action, name):
  action_format = base.ActionFormat("tool_call", tools)
  reply = action_format.reply("A thought.", action)
  call = json.loads(reply.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
  assert call["name"] == name
  assert action_format.tools[name].action_text(call["arguments"]) == action


def test_aliases_are_read_and_written_in_the_main_spelling():
  look_at, put_down = sciworld_env.TOOLS[1], sciworld_env.TOOLS[8]
  assert look_at.arguments_of("examine lead") == {"object": "lead"}
  assert look_at.action_text({"object": "lead"}) == "look at lead"
  assert put_down.action_text(
      put_down.arguments_of("drop sodium chloride")) == ("put down sodium chloride")


def test_react_format_leaves_replies_as_they_are():
  react = base.ActionFormat("react", textcraft_env.TOOLS)
  assert react.schemas is None
  assert react.reply("Go.", "inventory") == "Thought: Go.\n\nAction: inventory"
  assert react.react_reply("<tool_call>{}</tool_call>") == "<tool_call>{}</tool_call>"
  assert TEXTCRAFT.schemas == [tool.schema() for tool in textcraft_env.TOOLS]
  with pytest.raises(ValueError, match="action_format"):
    base.ActionFormat("json", textcraft_env.TOOLS)
  with pytest.raises(base.ExpertError, match="no tool stands for"):
    TEXTCRAFT.reply("Fly.", "fly to the moon")


@pytest.mark.parametrize(
    "reply,react",
    [
        (_call("get", {"count": 2, "item": "oak logs"}), "Thought: \n\nAction: get 2 oak logs"),
        ('<think>hmm</think><tool_call>{"name": "inventory"}</tool_call>',
         "Thought: \n\nAction: inventory"),
        # Llama 3.1's template asks for a bare object with "parameters".
        ('{"name": "get", "parameters": {"count": 1, "item": "sand"}}',
         "Thought: \n\nAction: get 1 sand"),
    ])
def test_a_tool_call_becomes_the_react_reply_with_its_action(reply, react):
  assert TEXTCRAFT.react_reply(reply) == react


@pytest.mark.parametrize("reply,why", [
    ("Action: get 2 oak logs", "the reply calls no tool"),
    ("<tool_call>{\"name\": \"get\"", "has no closing </tool_call>"),
    ("<tool_call>{'name': 'get'}</tool_call>", "not valid JSON (Expecting property name"),
    ("<tool_call>[1, 2]</tool_call>", 'must be a JSON object with a "name"'),
    ('<tool_call>{"name": "get", "arguments": [2]}</tool_call>', '"arguments" must be a JSON'),
    (_call("fly", {}), "there is no tool 'fly'"),
    (_call("get", {"count": 2}), "get needs the argument 'item'"),
    (_call("get", {"count": "2", "item": "sand"}), "'count' must be an integer, got '\"2\"'"),
    (_call("get", {"count": True, "item": "sand"}), "'count' must be an integer, got 'true'"),
    (_call("get",
           {"count": 2, "item": "sand", "quality": "fine"}), "get has no argument 'quality'"),
    (_call("craft", {"count": 1, "target": "bed", "ingredients": [3, "wool"]}),
     "'ingredients' must be an array of strings"),
    (_call("inventory", {}) + _call("inventory", {}), "a reply calls one tool, this one calls 2"),
    ("<tool_call>" + "9" * 5000 + "</tool_call>", "not usable JSON"),
])
def test_bad_calls_raise_tool_call_errors_that_say_why(reply, why):
  with pytest.raises(base.ToolCallError) as raised:
    TEXTCRAFT.react_reply(reply)
  message = str(raised.value)
  assert message.startswith("Invalid tool call: ") and why in message, message
  assert message.endswith("Call one of the tools (get, craft, inventory) as "
                          '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.')


def test_enums_are_checked():
  scroll = base.ActionFormat("tool_call", webarena_env.TOOLS)
  with pytest.raises(base.ToolCallError, match="'direction' must be one of down, up, got 'left'"):
    scroll.react_reply(_call("scroll", {"direction": "left"}))


@hypothesis.given(
    _replies(["get", "craft", "inventory", "x"], ["count", "item", "target", "ingredients", "y"],
             st.none() | st.integers() | st.text(max_size=5)
             | st.lists(st.text(max_size=5), max_size=2) | st.booleans()))
@hypothesis.settings(max_examples=300, deadline=None)
def test_any_reply_is_a_react_reply_or_a_tool_call_error(reply):
  try:
    assert isinstance(TEXTCRAFT.react_reply(reply), str)
  except base.ToolCallError:
    pass


# Each environment: a call acts as the ReAct reply with its action; a bad call is an error
# observation that leaves the episode as it was.

# (env, task id, actions); the calls' observations must equal the ReAct replies'.
_EPISODES = [
    ("textcraft", 0, ["inventory", "get 1 oak logs", "craft 9 stick using 1 planks", "inventory"]),
    ("searchqa", 0, ["<search> Orange Wool </search>", "<answer> nothing </answer>"]),
    ("babyai", 92, ["turn left", "move forward", "pick up", "check available actions"]),
]


@pytest.mark.parametrize("name,task_id,actions", _EPISODES, ids=[e[0] for e in _EPISODES])
def test_calls_play_as_the_react_replies_with_their_actions(name, task_id, actions):
  with contextlib.closing(base.make(name)) as react, contextlib.closing(
      base.make(name, action_format="tool_call")) as tool:
    assert react.reset(task_id) == tool.reset(task_id)
    assert base.tools_of(react) is None
    assert base.tools_of(tool) == tool.action_format.schemas
    assert base.TOOL_CALL_INSTRUCTION in tool.instruction
    assert base.TOOL_CALL_INSTRUCTION not in react.instruction
    for action in actions:
      expected = react.step(base.reply_for(react, "A thought.", action))
      assert tool.step(base.reply_for(tool, "A thought.", action)) == expected


@pytest.mark.parametrize("name,task_id", [(name, task_id) for name, task_id, _ in _EPISODES])
def test_a_bad_call_is_an_error_observation_and_the_episode_goes_on(name, task_id):
  with contextlib.closing(base.make(name, action_format="tool_call")) as env:
    env.reset(task_id)
    first = next(iter(env.action_format.tools))
    for reply, why in (("<tool_call>{\"name\": </tool_call>", ""), (_call("fly", {}), ""),
                       (_call(first, {"nonsense": 1}), f"{first} has no argument 'nonsense'")):
      result = env.step(reply)
      assert result.observation.startswith(f"Invalid tool call: {why}")
      assert (result.reward, result.done, result.info["success"]) == (0.0, False, False)


def test_the_textcraft_instruction_shows_its_example_as_tool_calls():
  instruction = base.make("textcraft", action_format="tool_call").instruction
  assert ('{"name": "craft", "arguments": {"count": 4, "target": "stick", "ingredients": '
          '["2 oak planks"]}}\n</tool_call>\nObservation: Crafted 4 minecraft:stick') in instruction
  assert "Action:" not in instruction and "Thought:" not in instruction


@hypothesis.given(
    _replies(["get", "craft", "inventory"], ["count", "item", "target", "ingredients"],
             st.integers(-3, 10**6) | st.text(max_size=20)
             | st.lists(st.text(max_size=12), max_size=3)))
@hypothesis.settings(max_examples=200, deadline=None)
def test_any_reply_in_the_tool_call_format_gets_an_observation(reply):
  env = textcraft_env.TextCraftEnv(action_format="tool_call")
  env.reset(0)
  result = env.step(reply)
  assert isinstance(result.observation, str) and result.observation
