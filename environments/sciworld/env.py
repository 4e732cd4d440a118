"""SciWorldEnv: elementary science experiments in ScienceWorld, through the `scienceworld` JVM.

Episode. reset(task_id) loads the task's variation (see tasks.py) and returns the task
description, a newline, and the room the agent starts in ("look around"), as AgentGym's
server does. Each step sends the action in the reply to the simulator and returns its text
unchanged, including its answer to an action it cannot parse, "No known action matches that
input." (INVALID_ACTION), and its numbered choices for an ambiguous action, which the agent
answers with a number. A reply with no "Action:" gets INVALID_ACTION without reaching the
simulator: the reference sends such a reply whole and gets that answer. In the tool_call format
(environments/base.py) the actions are TOOLS, one per action template plus "choose" for a
numbered choice, and a call that cannot be carried out gets "Invalid tool call: <why>. ...".

The world of a (task, variation) is fixed, but the simulator keeps objects in Scala sets, so
the order in which it lists a room's objects (and numbers the choices of an ambiguous action)
can differ from one load to the next, and so, rarely, can heat transfer (ScienceWorld issues
#15 and #33). Episodes are reproducible up to that.

Score and reward. The simulator scores progress s_t in 0..100 after every step and sets it to
a negative value (-100) when the agent fails (for example by focusing on the wrong object).
The step reward is the change of the score, floored at 0 and normalised:

  r_t = (max(s_t, 0) - max(s_{t-1}, 0)) / 100,  s_0 = 0,

so the rewards of an episode sum to max(final score, 0) / 100 in [0, 1], and a failure takes
back the progress made. info["score"] is the simulator's score s_t (negative on failure) and
info["success"] is s_t == 100.

Done, as the package's ScienceWorldEnv.step decides: the simulator says the task is complete,
or the score is negative, or the simulator has counted more than `step_limit` moves (100, the
package's default and AgentGym's; unparseable actions are not moves).

JVM. Each adapter owns one simulator JVM, started by the first reset and kept for every later
episode: reset reloads the task only when (task, variation) changes and otherwise rewinds it.
Steps call the JVM directly for the observation, score, completion and move count; the
package's step() also collects the look, the inventory and every valid action for its info
dict, which costs several times more than the step itself. close() stops the JVM and its py4j
threads. A py4j failure raises EnvError and discards the JVM; the next reset starts a fresh one.

JVM memory. The simulator keeps about 15-25 MB alive but allocates tens of MB per episode
(every load and rewind rebuilds the world). The package starts the JVM with Java's defaults: a
heap of up to a quarter of the machine's memory, which the default collector (G1) grows toward
that limit rather than collect in place, so each JVM's resident memory rose by 20-35 MB per
episode up to about 2 GB. We start the JVM ourselves (the package has no option for it) with the
serial collector and a heap that starts at 64 MB and is shrunk back after collections
(`JVM_OPTIONS`), capped at `jvm_heap_mb`: a JVM then stays at about 160 MB over any number of
episodes. The cap is for generating gold paths, which needs far more than episodes
(test-conductivity: over 192 MB); a JVM out of memory exits, and the call raises EnvError like
any other simulator failure.
"""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
from typing import Any, Iterator, Sequence

from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
from py4j.protocol import Py4JError
from scienceworld.constants import BASEPATH, JAR_PATH

from environments import base
from environments.base import EnvError, StepResult
from environments.sciworld import tasks as tasks_lib

# py4j logs a traceback at INFO whenever a JVM we closed on purpose drops its gateway.
logging.getLogger("py4j").setLevel(logging.WARNING)

INVALID_ACTION = "No known action matches that input."
FULL_SCORE = 100
DEFAULT_STEP_LIMIT = 100
DEFAULT_JVM_HEAP_MB = 512
# The serial collector (one thread; several JVMs share few cores) on a heap that starts small and
# is given back after collections, keeping 20-40 % of it free; see "JVM memory" above.
JVM_OPTIONS = ("-XX:+UseSerialGC", "-Xms64m", "-XX:MinHeapFreeRatio=20", "-XX:MaxHeapFreeRatio=40",
               "-XX:+ExitOnOutOfMemoryError")
# How long close() lets the JVM exit after the gateway shuts down before killing it.
_JVM_EXIT_GRACE_S = 10.0

# (template, what it does); OBJ and LOC stand for names the observations use.
ACTIONS = (
    ("look around", "describe the room you are in"),
    ("look at OBJ", "describe an object in detail"),
    ("look in OBJ", "list what a container holds"),
    ("read OBJ", "read a book or a note"),
    ("go to LOC", "move to a neighbouring location through an open door"),
    ("open OBJ / close OBJ", "open or close a door or a container"),
    ("pick up OBJ", "take an object into your inventory"),
    ("put down OBJ", "drop an object from your inventory"),
    ("move OBJ to OBJ", "put an object in a container or on a surface"),
    ("pour OBJ in OBJ", "pour a liquid into a container"),
    ("dunk OBJ in OBJ", "dip a container into a liquid"),
    ("mix OBJ", "chemically mix the contents of a container"),
    ("activate OBJ / deactivate OBJ", "switch a device on or off"),
    ("use OBJ on OBJ", "use a tool or device on something (\"use OBJ\" for a device alone)"),
    ("connect OBJ to OBJ / disconnect OBJ", "wire or unwire electrical components"),
    ("eat OBJ", "eat a food"),
    ("flush OBJ", "flush a toilet"),
    ("focus on OBJ", "declare the object the task is about; only when the task asks for it, "
     "since focusing on the wrong object fails the task"),
    ("wait / wait1", "let 10 time steps / 1 time step pass"),
    ("inventory", "list what you are carrying"),
    ("task", "repeat the task description"),
)

INSTRUCTION = f"""\
You are an agent in ScienceWorld, a text simulation of a house and its surroundings where you \
carry out elementary science experiments. The first observation states your task and describes \
the room you start in. Each round you see an observation and reply with one action. Your score \
(0 to 100) rises as you complete parts of the task; the task is solved at 100. Some mistakes, \
such as focusing on the wrong object, fail the task at once.

Actions (OBJ is an object and LOC a location, named as the observations name them):
{chr(10).join(f"- {template}: {meaning}" for template, meaning in ACTIONS)}
When an action could mean several objects you are shown numbered choices; reply with the \
number as your action.

{{reply_format}}"""


def _tool(name: str, action: str, description: str, *parameters: str,
          aliases: tuple[str, ...] = ()) -> base.Tool:
  """A tool for one action template; a parameter named "location" is a location, any other an
  object. `aliases`: the simulator's other spellings of the action, which gold paths use."""
  kinds = {
      "object": "An object, named as the observations name it.",
      "location": "A location, named as the observations name it."
  }
  return base.Tool(
      name, description, action,
      tuple(
          base.Parameter(parameter, "string", kinds.get(parameter, kinds["object"]))
          for parameter in parameters), aliases)


# The tools of the tool_call format, one per action of ACTIONS.
TOOLS = (_tool("look_around", "look around", "Describe the room you are in."),
         _tool("look_at", "look at {object}", "Describe an object in detail.", "object",
               aliases=("examine {object}",)),
         _tool("look_in", "look in {object}", "List what a container holds.",
               "object"), _tool("read", "read {object}", "Read a book or a note.", "object"),
         _tool("go_to", "go to {location}", "Move to a neighbouring location through an open door.",
               "location"), _tool("open", "open {object}", "Open a door or a container.", "object"),
         _tool("close", "close {object}", "Close a door or a container.", "object"),
         _tool("pick_up", "pick up {object}", "Take an object into your inventory.", "object"),
         _tool("put_down", "put down {object}", "Drop an object from your inventory.", "object",
               aliases=("drop {object}",)),
         _tool("move", "move {object} to {destination}",
               "Put an object in a container or on a surface.", "object", "destination"),
         _tool("pour", "pour {object} into {destination}", "Pour a liquid into a container.",
               "object", "destination", aliases=("pour {object} in {destination}",)),
         _tool("dunk", "dunk {object} into {liquid}", "Dip a container into a liquid.", "object",
               "liquid", aliases=("dunk {object} in {liquid}",)),
         _tool("mix", "mix {object}", "Chemically mix the contents of a container.",
               "object"), _tool("activate", "activate {object}", "Switch a device on.", "object"),
         _tool("deactivate", "deactivate {object}", "Switch a device off.", "object"),
         _tool("use_on", "use {object} on {target}", "Use a tool or device on something.", "object",
               "target"), _tool("use", "use {object}", "Use a device by itself.", "object"),
         _tool("connect", "connect {object} to {target}", "Wire two electrical components.",
               "object", "target"),
         _tool("disconnect", "disconnect {object}", "Unwire an electrical component.",
               "object"), _tool("eat", "eat {object}", "Eat a food.", "object"),
         _tool("flush", "flush {object}", "Flush a toilet.", "object"),
         _tool(
             "focus_on", "focus on {object}", "Declare the object the task is about; only when the "
             "task asks for it, since focusing on the wrong object fails the task.",
             "object"), _tool("wait", "wait", "Let 10 time steps pass."),
         _tool("wait1", "wait1", "Let 1 time step pass."),
         _tool("inventory", "inventory",
               "List what you are carrying."), _tool("task", "task",
                                                     "Repeat the task description."),
         base.Tool(
             "choose", "Answer numbered choices (shown when an action could mean several "
             "objects) with the number of one.", "{number}",
             (base.Parameter("number", "integer", "The number of the choice."),)))

_ACTION_MARKER = re.compile(r"action\s*:", re.IGNORECASE)


def parse_action(reply: str) -> str | None:
  """The action of a reply: the first non-empty line after its first "Action:", or None.

  Like AgentGym's client this reads the text after the first marker; the first line keeps a
  reply that runs on ("Action: go to kitchen\\nObservation: ...") to its one action.
  """
  match = _ACTION_MARKER.search(reply)
  if match is None:
    return None
  # Text the JVM bridge cannot encode (lone surrogates) is the model's fault, not the
  # simulator's: replace it rather than let py4j fail and take the JVM down with it.
  text = reply[match.end():].encode("utf-8", "replace").decode("utf-8")
  lines = [line.strip() for line in text.splitlines()]
  return next((line for line in lines if line), None)


class _Simulator:
  """One ScienceWorld JVM: the few calls an episode needs, and a close that always ends it.

  It talks to the simulator's Python interface as the package's ScienceWorldEnv does, without
  the callback server (the simulator never calls Python) and with our JVM options.
  """

  def __init__(self, heap_mb: int):
    # die_on_exit: the JVM exits when its stdin closes, so it cannot outlive this process.
    port, self._java_process = launch_gateway(classpath=JAR_PATH,
                                              javaopts=[*JVM_OPTIONS, f"-Xmx{heap_mb}m"],
                                              die_on_exit=True, cwd=BASEPATH, return_proc=True)
    try:
      self._gateway = JavaGateway(gateway_parameters=GatewayParameters(port=port),
                                  java_process=self._java_process)
      self._server = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
    except Exception:
      self._stop_java()
      raise

  @property
  def pid(self) -> int:
    return self._java_process.pid

  def load(self, task_name: str, variation: int, gold_path: bool = False) -> None:
    error = self._server.load(task_name, variation, "", gold_path)
    if error:
      raise EnvError(f"the simulator could not load {task_name} variation {variation}: {error}")

  def rewind(self) -> None:
    """Back to the start of the loaded task and variation."""
    self._server.reset()

  def act(self, action: str) -> tuple[str, int, bool, int]:
    """(observation, score in 0..100 or negative, task complete, moves so far)."""
    observation = self._server.step(action)
    score = int(round(100 * self._server.getScore()))  # the package's own conversion
    return observation, score, bool(self._server.getCompleted()), self._server.getNumMoves()

  def task_description(self) -> str:
    return self._server.getTaskDescription()

  def gold_actions(self) -> list[str]:
    return list(self._server.getGoldActionSequence())

  def close(self) -> None:
    self._gateway.shutdown()  # never raises; a JVM already gone is fine
    self._stop_java()

  def _stop_java(self) -> None:
    """Closes the JVM's stdin (it exits, see die_on_exit), waits for it, kills it if need be."""
    with contextlib.suppress(OSError):
      self._java_process.stdin.close()
    try:
      self._java_process.wait(timeout=_JVM_EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
      self._java_process.kill()
      self._java_process.wait()


class SciWorldEnv:
  """One ScienceWorld episode at a time (the `environments.base.Env` protocol)."""

  name = "sciworld"

  def __init__(self, step_limit: int = DEFAULT_STEP_LIMIT, jvm_heap_mb: int = DEFAULT_JVM_HEAP_MB,
               action_format: str = "react"):
    """Args: step_limit, the moves an episode may take; jvm_heap_mb, the simulator's heap cap
    (see "JVM memory" in the module docstring; at least 64); action_format, react or tool_call
    (environments/base.py; the tools are TOOLS)."""
    for name, value, least in (("step_limit", step_limit, 1), ("jvm_heap_mb", jvm_heap_mb, 64)):
      if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    self.step_limit = step_limit
    self.action_format = base.ActionFormat(action_format, TOOLS)
    self.jvm_heap_mb = jvm_heap_mb
    self._simulator: _Simulator | None = None
    self._loaded: tuple[str, int] | None = None  # (task name, variation) in the simulator
    self._score = 0
    self._done = True
    self._closed = False

  @property
  def instruction(self) -> str:
    return INSTRUCTION.format(reply_format=self.action_format.reply_format())

  def task_ids(self, split: str) -> Sequence[int]:
    return tasks_lib.split_ids(split)

  def task_info(self, task_id: int) -> dict[str, Any]:
    return tasks_lib.task_info(task_id)

  def reset(self, task_id: int) -> str:
    task, variation = tasks_lib.lookup(task_id)
    simulator = self._running_simulator()
    self._done = True
    with self._faults_end_the_simulator():
      if self._loaded == (task.name, variation):
        simulator.rewind()
      else:
        self._loaded = None
        simulator.load(task.name, variation)
        self._loaded = (task.name, variation)
      look, _, _, _ = simulator.act("look around")
      description = simulator.task_description()
    self._score, self._done = 0, False
    return f"{description}\n{look}"

  def step(self, action_text: str) -> StepResult:
    if self._done or self._simulator is None:
      raise RuntimeError("step() without an episode in progress; call reset() first")
    try:
      action = parse_action(self.action_format.react_reply(action_text))
    except base.ToolCallError as error:
      return StepResult(str(error), 0.0, False, self._info(self._score, None))
    if action is None:
      return StepResult(INVALID_ACTION, 0.0, False, self._info(self._score, action))
    with self._faults_end_the_simulator():
      observation, score, complete, moves = self._simulator.act(action)
    reward = (max(score, 0) - max(self._score, 0)) / FULL_SCORE
    self._score = score
    self._done = complete or score < 0 or moves > self.step_limit
    return StepResult(observation, reward, self._done, self._info(score, action))

  def gold_actions(self, task_id: int) -> list[str]:
    """The package's gold action sequence for a task (it may run past the winning action).

    Generating it can take tens of seconds; it ends any episode in progress.
    """
    task, variation = tasks_lib.lookup(task_id)
    simulator = self._running_simulator()
    self._done = True
    # A task loaded with its gold path would regenerate it on every rewind: reload next reset.
    self._loaded = None
    with self._faults_end_the_simulator():
      simulator.load(task.name, variation, gold_path=True)
      return simulator.gold_actions()

  def close(self) -> None:
    self._closed, self._done = True, True
    self._stop_simulator()

  def __enter__(self) -> SciWorldEnv:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()

  @property
  def jvm_pid(self) -> int | None:
    """The process id of this adapter's JVM, None while none runs."""
    return None if self._simulator is None else self._simulator.pid

  def _info(self, score: int, action: str | None) -> dict[str, Any]:
    return {"score": score, "success": score == FULL_SCORE, "action": action}

  def _running_simulator(self) -> _Simulator:
    if self._closed:
      raise RuntimeError("this SciWorldEnv is closed; make a new one")
    if self._simulator is None:
      try:
        self._simulator = _Simulator(self.jvm_heap_mb)
      except Exception as e:  # OSError without `java`; py4j raises plain Exceptions.
        raise EnvError(f"could not start the ScienceWorld JVM (is Java installed?): {e}") from e
    return self._simulator

  def _stop_simulator(self) -> None:
    simulator, self._simulator, self._loaded = self._simulator, None, None
    if simulator is not None:
      simulator.close()

  @contextlib.contextmanager
  def _faults_end_the_simulator(self) -> Iterator[None]:
    """Turns a py4j failure into EnvError and discards the JVM, which may be broken or gone."""
    try:
      yield
    except Py4JError as e:
      self._done = True
      self._stop_simulator()
      raise EnvError(f"the ScienceWorld simulator failed: {e}") from e
