"""The environment adapter protocol, the registry of adapters, and the two action formats.

An adapter wraps one episode at a time of one environment. The rollout talks to adapters only
through this protocol (usually via `environments.pool.EnvPool`), so a new environment plugs in
by implementing five methods and registering a name; the training code never changes.

Conversation contract (what the rollout renders):
  user:      adapter.instruction + "\n\n" + reset(task_id)
  assistant: a reply carrying one action
  user:      step(reply).observation
  ...
Rewards are per step; the episode's outcome reward is their sum. `info["success"]` says whether
the task was solved (for SciWorld success means score 100, while the reward is the score / 100).

Action formats (`ActionFormat`, an adapter's `action_format` attribute; env.action_format in
the config). "react", the paper's: the reply is text in the environment's own grammar, usually
"Thought: ...\n\nAction: ...". "tool_call": the environment publishes its actions as tools
(`Tool`: a JSON schema for the model's template, and the action text it stands for) and a
reply calls one:

  I need planks first.
  <tool_call>
  {"name": "get", "arguments": {"count": 2, "item": "oak planks"}}
  </tool_call>

(Llama 3.1's template asks for a bare `{"name": ..., "parameters": ...}` object instead; that is
read too.) The call is checked against the tool's schema and turned into the ReAct reply with
the same action, which the environment then parses as usual, so both formats reach the same
actions and observations. Malformed JSON, an unknown tool or wrong arguments raise
ToolCallError, whose message the environment returns as its error observation; never an
exception out of `step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
import re
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

SPLITS = ("train", "test")
ACTION_FORMATS = ("react", "tool_call")
# The environments whose adapters take an `action_format` option.
TOOL_CALL_ENVS = ("textcraft", "babyai", "sciworld", "searchqa", "webarena")

# The reply format of the tool_call format, as environment instructions state it.
TOOL_CALL_INSTRUCTION = """\
Each reply: think briefly, then call exactly one of the tools, written as
<tool_call>
{"name": <tool name>, "arguments": {<argument name>: <value>, ...}}
</tool_call>"""
# The reply format of `react_reply`, as environment instructions state it.
REACT_INSTRUCTION = """\
Reply in exactly this format:
Thought: <your reasoning>

Action: <one action>"""


def react_reply(thought: str, action: str) -> str:
  """A reply in the ReAct format most environments' instructions ask for."""
  return f"Thought: {thought}\n\nAction: {action}"


def tool_call_reply(thought: str, name: str, arguments: Mapping[str, Any]) -> str:
  """A reply in the tool_call format: the thought, then the call."""
  call = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
  return f"{thought}\n\n<tool_call>\n{call}\n</tool_call>"


class ToolCallError(ValueError):
  """A reply whose tool call cannot be carried out; the message is shown to the agent."""


_JSON_TYPES = {"string": str, "integer": int, "array": list}


@dataclasses.dataclass(frozen=True)
class Parameter:
  """One argument of a tool: "string", "integer", or "array" (of strings)."""

  name: str
  type: str
  description: str
  required: bool = True
  enum: tuple[Any, ...] = ()

  def __post_init__(self):
    if self.type not in _JSON_TYPES:
      raise ValueError(f"parameter {self.name!r}: type {self.type!r} is not one of "
                       f"{sorted(_JSON_TYPES)}")

  def schema(self) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": self.type, "description": self.description}
    if self.type == "array":
      schema["items"] = {"type": "string"}
    if self.enum:
      schema["enum"] = list(self.enum)
    return schema

  def check(self, tool: str, value: Any) -> None:
    """Raises ToolCallError unless `value` fits the schema."""
    fits = isinstance(value, _JSON_TYPES[self.type]) and not isinstance(value, bool)
    if fits and self.type == "array":
      fits = all(isinstance(item, str) for item in value)
    if not fits:
      kind = {"string": "a string", "integer": "an integer",
              "array": "an array of strings"}[self.type]
      raise ToolCallError(f"{tool}'s argument {self.name!r} must be {kind}, got "
                          f"{_shown(json.dumps(value, ensure_ascii=False))}")
    if self.enum and value not in self.enum:
      raise ToolCallError(f"{tool}'s argument {self.name!r} must be one of "
                          f"{', '.join(map(str, self.enum))}, got {_shown(str(value))}")


@dataclasses.dataclass(frozen=True)
class Tool:
  """One action as a function the model calls: its JSON schema and the action text it stands
  for.

  `action` spells the environment's action with the arguments in braces, e.g.
  "craft {count} {target} using {ingredients}": an array is joined with ", ", and an optional
  argument that is left out drops its placeholder with the text attached to it and the space
  before ("type [{id}] [{text}] [{enter}]" without enter: "type [{id}] [{text}]"). `aliases`
  are other spellings of the same action that `arguments_of` reads too ("examine {object}" for
  "look at {object}"), for experts whose actions use them.
  """

  name: str
  description: str
  action: str
  parameters: tuple[Parameter, ...] = ()
  aliases: tuple[str, ...] = ()

  def schema(self) -> dict[str, Any]:
    """The OpenAI-style function schema chat templates render."""
    return {
        "type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": {
                "type": "object", "properties": {p.name: p.schema() for p in self.parameters},
                "required": [p.name for p in self.parameters if p.required]
            }
        }
    }

  def action_text(self, arguments: Mapping[str, Any]) -> str:
    """The action of a call with `arguments`; ToolCallError if they do not fit the schema."""
    known = {p.name: p for p in self.parameters}
    unknown = sorted(set(arguments) - set(known))
    if unknown:
      raise ToolCallError(f"{self.name} has no argument {unknown[0]!r} (its arguments: "
                          f"{', '.join(known) or 'none'})")
    text, values = self.action, {}
    for parameter in self.parameters:
      if parameter.name not in arguments:
        if parameter.required:
          raise ToolCallError(f"{self.name} needs the argument {parameter.name!r}")
        text = re.sub(_attached(parameter.name), "", text, count=1)
        continue
      value = arguments[parameter.name]
      parameter.check(self.name, value)
      values[parameter.name] = ", ".join(value) if parameter.type == "array" else str(value)
    return re.sub(r"\{(\w+)\}", lambda match: values[match.group(1)], text)

  def arguments_of(self, action: str) -> dict[str, Any] | None:
    """The arguments of the call that stands for `action`, or None if this tool cannot."""
    match = next(
        filter(None, (_pattern(spelling, self.parameters).fullmatch(action)
                      for spelling in (self.action, *self.aliases))), None)
    if match is None:
      return None
    arguments = {}
    for parameter in self.parameters:
      value = match.group(parameter.name)
      if value is None:
        continue
      if parameter.type == "integer":
        value = int(value)
      elif parameter.type == "array":
        value = value.split(", ")
      arguments[parameter.name] = value
    return arguments


def _pattern(action: str, parameters: Sequence[Parameter]) -> re.Pattern[str]:
  """A regex reading the arguments out of action text spelled as `action` (see Tool)."""
  pattern = re.escape(action)
  for parameter in parameters:
    value = "[0-9]+" if parameter.type == "integer" else ".*?"
    group = f"(?P<{parameter.name}>{value})"
    escaped = re.escape(f"{{{parameter.name}}}")
    if parameter.required:
      pattern = pattern.replace(escaped, group)
      continue
    segment = re.search(_attached(parameter.name), action).group(0)
    pattern = pattern.replace(re.escape(segment),
                              f"(?:{re.escape(segment).replace(escaped, group)})?")
  return re.compile(pattern, re.DOTALL)


def _attached(name: str) -> str:
  """A regex for an optional placeholder with the text attached to it and the space before."""
  return rf" ?[^\s{{}}]*\{{{name}\}}[^\s{{}}]*"


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ActionFormat:
  """How an environment's replies carry actions (module docstring): `kind` "react" or
  "tool_call", the environment's `tools`, and `react(thought, action)`, its ReAct reply."""

  def __init__(self, kind: str, tools: Sequence[Tool], react: Callable[[str, str],
                                                                       str] = react_reply):
    if kind not in ACTION_FORMATS:
      raise ValueError(f"action_format={kind!r} is not one of {ACTION_FORMATS}")
    self.kind = kind
    self.tools = {tool.name: tool for tool in tools}
    self._react = react

  @property
  def schemas(self) -> list[dict[str, Any]] | None:
    """The tools' JSON schemas, for the chat template; None in the react format."""
    return [tool.schema() for tool in self.tools.values()] if self.kind == "tool_call" else None

  def reply_format(self) -> str:
    """The reply format as an environment's instruction states it: TOOL_CALL_INSTRUCTION in the
    tool_call format, else REACT_INSTRUCTION."""
    return TOOL_CALL_INSTRUCTION if self.kind == "tool_call" else REACT_INSTRUCTION

  def reply(self, thought: str, action: str) -> str:
    """A reply carrying the environment action `action` (an expert's), in this format;
    ExpertError if no tool stands for it."""
    if self.kind == "react":
      return self._react(thought, action)
    for tool in self.tools.values():
      arguments = tool.arguments_of(action)
      if arguments is not None:
        return tool_call_reply(thought, tool.name, arguments)
    raise ExpertError(f"no tool stands for the action {action!r}")

  def react_reply(self, reply: str) -> str:
    """The ReAct reply the environment parses for `reply`: itself in the react format; in the
    tool_call format, the action of its tool call (ToolCallError if there is none)."""
    if self.kind == "react":
      return reply
    try:
      name, arguments = _tool_call(reply)
      if name not in self.tools:
        raise ToolCallError(f"there is no tool {_shown(name)}")
      return self._react("", self.tools[name].action_text(arguments))
    except ToolCallError as error:
      raise ToolCallError(
          f"Invalid tool call: {error}. Call one of the tools ({', '.join(self.tools)}) as "
          '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.') from None


def _tool_call(reply: str) -> tuple[str, dict[str, Any]]:
  """(name, arguments) of the one tool call in a reply."""
  calls = _TOOL_CALL.findall(reply)
  if len(calls) > 1:
    raise ToolCallError(f"a reply calls one tool, this one calls {len(calls)}")
  if calls:
    text = calls[0]
  elif "<tool_call>" in reply:
    raise ToolCallError("the <tool_call> has no closing </tool_call>")
  elif reply.strip().startswith("{"):
    text = reply  # Llama 3.1's bare JSON call.
  else:
    raise ToolCallError("the reply calls no tool")
  try:
    call = json.loads(text)
  except json.JSONDecodeError as error:
    raise ToolCallError(
        f"the call is not valid JSON ({error.msg} at character {error.pos})") from None
  except (ValueError, RecursionError) as error:  # Over-long integers, deep nesting.
    raise ToolCallError(f"the call is not usable JSON ({_shown(str(error))})") from None
  if not isinstance(call, dict) or not isinstance(call.get("name"), str):
    raise ToolCallError('the call must be a JSON object with a "name"')
  arguments = call.get("arguments", call.get("parameters", {}))
  if not isinstance(arguments, dict):
    raise ToolCallError('the call\'s "arguments" must be a JSON object')
  return call["name"], arguments


def _shown(text: str) -> str:
  return repr(text if len(text) <= 80 else text[:77] + "...")


def tools_of(env: Env) -> list[dict[str, Any]] | None:
  """The JSON schemas of an adapter's tools in the tool_call format, else None."""
  action_format = getattr(env, "action_format", None)
  return None if action_format is None else action_format.schemas


def reply_for(env: Env, thought: str, action: str) -> str:
  """An expert's reply carrying `action` in the adapter's action format (ReAct without one)."""
  action_format = getattr(env, "action_format", None)
  return react_reply(thought, action) if action_format is None else action_format.reply(
      thought, action)


class ExpertError(RuntimeError):
  """An environment's expert could not produce replies for a task."""


# Why an episode ended: its own end, the rollout's turn cap or context limit, or a failure of
# its environment (an exception, or a step slower than the pool's timeout).
DONE, HORIZON, CONTEXT, ENV_ERROR, ENV_TIMEOUT = ("done", "horizon", "context", "env_error",
                                                  "env_timeout")


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one env step returns: the next observation and the step's reward."""

  observation: str
  reward: float
  done: bool
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
  """One episode at a time of one environment.

  Task ids are non-negative ints, stable across machines, processes and PYTHONHASHSEED, and
  disjoint between splits. They are the `data_idx` of the AgentGym HTTP protocol.
  """

  name: str

  @property
  def instruction(self) -> str:
    """The environment's rules and reply format, shown before the first observation."""

  def task_ids(self, split: str) -> Sequence[int]:
    """All task ids of `split` (one of SPLITS), in a fixed order."""

  def task_info(self, task_id: int) -> dict[str, Any]:
    """Metadata of a task; has a "category" key used to break down evaluation."""

  def reset(self, task_id: int) -> str:
    """Starts an episode of task `task_id`; returns the first observation."""

  def step(self, action_text: str) -> StepResult:
    """Applies the model's whole reply (the adapter parses the action out of it)."""

  def close(self) -> None:
    """Releases processes, sockets and files. Idempotent."""


class EnvError(RuntimeError):
  """An environment failed (not the agent): ends that episode, never the batch."""


def check_split(split: str) -> str:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  return split


# The entry-point group in which an installed package declares its adapters, e.g. in its
# pyproject.toml (docs/environments.md):
#   [project.entry-points."agentgym_jax.environments"]
#   arithmetic = "my_envs.arithmetic:ArithmeticEnv"
ENTRY_POINT_GROUP = "agentgym_jax.environments"

# name -> a factory `(**options) -> Env`: a callable, a "module:attribute" path, or an installed
# package's entry point. Modules are imported on first use so that heavy dependencies (a JVM,
# minigrid) load only for the environments a run makes.
_REGISTRY: dict[str, str | Callable[..., Env] | importlib.metadata.EntryPoint] = {
    "textcraft": "environments.textcraft:TextCraftEnv",
    "babyai": "environments.babyai:BabyAIEnv",
    "sciworld": "environments.sciworld:SciWorldEnv",
    "searchqa": "environments.searchqa:SearchQAEnv",
    "webarena": "environments.webarena:WebArenaEnv",
    "webarena_remote": "environments.webarena:AgentGymWebArenaClient",
    "echo": "environments.echo:EchoEnv",
    "http": "environments.http.client:AgentGymClient",
}
# The built-in environments whose simulators come with an extra of the package: the extra and
# the top-level modules it installs.
_EXTRAS = {
    "babyai": ("babyai", ("minigrid", "gymnasium")),
    "sciworld": ("sciworld", ("scienceworld", "py4j")),
    "searchqa": ("searchqa", ("bm25s", "pyarrow", "faiss")),
    "webarena": ("webarena", ("playwright",)),
}
_entry_points_read = False


class AdapterImportError(ImportError):
  """An environment's adapter cannot be loaded: its extra is not installed, or an installed
  package's entry point fails to import."""


def register(name: str, factory: str | Callable[..., Env]) -> None:
  """Registers `factory` (a callable or a "module:attribute" path) under `name`; it replaces
  whatever the name stood for, an installed package's entry point included."""
  _REGISTRY[name] = factory


def registered() -> list[str]:
  """The names `make` knows: the built-in environments, those registered in code and those of
  installed packages (ENTRY_POINT_GROUP)."""
  _read_entry_points()
  return sorted(_REGISTRY)


def factory(name: str) -> Callable[..., Env]:
  """The callable that builds adapters of the environment registered as `name` (its module
  imported now): ValueError for an unknown name, AdapterImportError for one that cannot load."""
  if name not in _REGISTRY:
    _read_entry_points()
  if name not in _REGISTRY:
    raise ValueError(f"unknown environment {name!r}; registered: {', '.join(registered())}")
  found = _REGISTRY[name]
  if isinstance(found, importlib.metadata.EntryPoint):
    try:
      return found.load()
    except Exception as error:  # Anything the package's import raises.
      package = f"package {found.dist.name}'s" if found.dist is not None else "the"
      raise AdapterImportError(
          f"environment {name!r}: {package} entry point {found.value!r} (group "
          f"{ENTRY_POINT_GROUP}) failed to load: {type(error).__name__}: {error}") from error
  if isinstance(found, str):
    module_name, attribute = found.split(":")
    with _extra_needed(name):
      return getattr(importlib.import_module(module_name), attribute)
  return found


def make(name: str, **options: Any) -> Env:
  """Builds a fresh adapter of the environment registered as `name`."""
  build = factory(name)
  with _extra_needed(name):
    return build(**options)


def _read_entry_points() -> None:
  """Adds the adapters installed packages declare in ENTRY_POINT_GROUP, once per process, as
  entry points loaded by `factory`. A name already registered keeps its adapter."""
  global _entry_points_read
  if _entry_points_read:
    return
  _entry_points_read = True
  for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    _REGISTRY.setdefault(entry_point.name, entry_point)


@contextlib.contextmanager
def _extra_needed(name: str):
  """Turns the ImportError of a module that the environment's extra installs into one that
  says how to install it."""
  try:
    yield
  except ModuleNotFoundError as error:
    extra, modules = _EXTRAS.get(name, ("", ()))
    if (error.name or "").partition(".")[0] not in modules:
      raise
    raise AdapterImportError(f"environment {name!r} needs the {extra!r} extra ({error.name} is "
                             f"not installed): pip install 'agentgym-jax[{extra}]'") from error
