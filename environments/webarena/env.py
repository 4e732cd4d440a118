"""WebArenaEnv: complete WebArena tasks by browsing real web sites in Chromium.

Observation (WebArena's prompt template, as AgentGym's WebArena server fills it in), after
reset and after every step:

  OBSERVATION:
  Tab 0 (current): One Stop Shop

  [1] RootWebArea 'One Stop Shop' focused: True
  	[12] link 'Blue Kettle'
  	[20] textbox 'Search products' required: False
  URL: http://127.0.0.1:7770/
  OBJECTIVE: What is the price of the Blue Kettle?
  PREVIOUS ACTION: click [12] where [12] is link 'Blue Kettle'

The tree is the active tab's accessibility tree (accessibility.py), by default only what is in
the 1280x720 viewport. PREVIOUS ACTION is "None" at first; for element actions it says what the
element was, as WebArena's action history does, and if the page refused the action it adds
"(failed: <reason>)", which WebArena leaves out.

Replies carry one action between triple backticks (grammar: actions.py). A reply without a
well-formed action gets "Invalid action: <reason>. <format hint>" and leaves the page as it was.
In the tool_call format (environments/base.py) every command is a tool (TOOLS: click(element_id),
type(element_id, text, press_enter_after), ..., stop(answer)), and a call that cannot be carried
out gets "Invalid tool call: <why>. ...". Invalid and failed actions count as steps.

Reward. The episode ends at `stop [answer]`, or after `max_steps` actions (WebArena's run.py
limit is 30) with an empty answer; then the task's evaluators (evaluators.py) score it, and that
score, 1 or 0, is the final step's reward; every other step has reward 0. info["success"] says
whether the score is 1; info["scores"] has each evaluator's score; info["judge"], when the task
has fuzzy_match references, asks the run's judge (reward.judge mode "reference") to decide them
in place of the must_include stand-in (evaluators.py). A rollout that stops the
episode before either end (its own turn cap) gets no evaluation, as with AgentGym's server.

Tasks are WebArena task configs from `config_dir` (tasks.py), task id = the config's task_id,
splits by tasks.split. Site addresses for the configs' __SITE__ placeholders come from
WebArena's environment variables (SHOPPING, SHOPPING_ADMIN, REDDIT, GITLAB, WIKIPEDIA, MAP,
HOMEPAGE) and the `site_urls` option, which wins.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from environments import base
from environments.base import StepResult
from environments.webarena import actions, browser, tasks
from environments.webarena.actions import Action, ActionParseError

CONFIG_DIR_VARIABLE = "WEBARENA_CONFIG_DIR"
DEFAULT_CONFIG_DIR = "~/webarena/config_files"
SITE_VARIABLES = ("SHOPPING", "SHOPPING_ADMIN", "REDDIT", "GITLAB", "WIKIPEDIA", "MAP", "HOMEPAGE")
_TRUNCATED = "\n... (the rest of the page is cut)"

_INSTRUCTION = """\
You are operating a web browser to complete a task on some web sites. Each turn you are shown:
OBSERVATION: the open tabs, then the active tab's accessibility tree: one page element a line, \
written as [id] role 'name' with some of its properties, indented under the element that \
contains it.{viewport_note}
URL: the address of the active tab.
OBJECTIVE: the task to complete.
PREVIOUS ACTION: your last action, and why it failed if it did.

You act with these commands, where id is a number in brackets from the current observation:
click [id]: click the element.
type [id] [text] [press_enter_after=0|1]: click the element and type the text. Enter is \
pressed afterwards unless you end the command with [0].
hover [id]: move the mouse over the element.
press [key_comb]: press a key or a key combination, e.g. press [Enter] or press [Control+a].
scroll [direction=down|up]: scroll the page one window down or up.
new_tab: open a new empty tab and switch to it.
tab_focus [tab_index]: switch to the tab with that number (tabs are numbered from 0).
close_tab: close the active tab.
goto [url]: open a web address in the active tab.
go_back: go to the previous page of the tab's history.
go_forward: go to the next page of the tab's history.
stop [answer]: finish the task. If it asks for information, the answer is that information; if \
it asks you to do something, stop once it is done (the answer may be empty). If the task \
cannot be done, answer N/A.

Rules: issue one action per reply, and use only ids from the current observation. \
{reply_format}{limit_note}"""
_REACT_FORMAT = """\
Think about what to do first, then end your reply with the action between triple backticks, for \
example: In summary, the next action I will perform is ```click [1234]```
Only the first text between triple backticks is read."""
_TOOL_CALL_FORMAT = ("The commands are also tools, named as above with the arguments in "
                     "brackets as their arguments.")

_ID = base.Parameter("element_id", "integer", "The element's id in the current observation.")
TOOLS = (base.Tool("click", "Click the element.", "click [{element_id}]", (_ID,)),
         base.Tool(
             "type", "Click the element and type the text; Enter is pressed afterwards "
             "unless press_enter_after is 0.", "type [{element_id}] [{text}] "
             "[{press_enter_after}]",
             (_ID, base.Parameter("text", "string", "What to type."),
              base.Parameter("press_enter_after", "integer", "1 (the default) to press "
                             "Enter after typing, 0 not to.", required=False, enum=(0, 1)))),
         base.Tool("hover", "Move the mouse over the element.", "hover [{element_id}]", (_ID,)),
         base.Tool("press", "Press a key or a key combination.", "press [{key_comb}]",
                   (base.Parameter("key_comb", "string", 'E.g. "Enter" or "Control+a".'),)),
         base.Tool("scroll", "Scroll the page one window down or up.", "scroll [{direction}]",
                   (base.Parameter("direction", "string", "down or up.", enum=("down", "up")),)),
         base.Tool("new_tab", "Open a new empty tab and switch to it.", "new_tab"),
         base.Tool("tab_focus", "Switch to the tab with that number (tabs are numbered from 0).",
                   "tab_focus [{tab_index}]",
                   (base.Parameter("tab_index", "integer", "The tab's number."),)),
         base.Tool("close_tab", "Close the active tab.", "close_tab"),
         base.Tool("goto", "Open a web address in the active tab.", "goto [{url}]",
                   (base.Parameter("url", "string", "The address."),)),
         base.Tool("go_back", "Go to the previous page of the tab's history.", "go_back"),
         base.Tool("go_forward", "Go to the next page of the tab's history.", "go_forward"),
         base.Tool(
             "stop", "Finish the task with the answer (empty if the task asks for none; N/A "
             "if it cannot be done).", "stop [{answer}]",
             (base.Parameter("answer", "string", "The answer."),)))


def react_reply(thought: str, action: str) -> str:
  """A reply in WebArena's chain-of-thought format: the thought, then the fenced action."""
  return f"{thought} In summary, the next action I will perform is ```{action}```".lstrip()


def instruction_text(viewport_only: bool, max_steps: int | None,
                     action_format: str = "react") -> str:
  """The rules shown before the first observation, for WebArenaEnv's settings."""
  viewport_note = (" Only the part of the page inside the window is shown; scroll to see the "
                   "rest." if viewport_only else "")
  limit_note = (f" You have at most {max_steps} actions; the task is judged when you stop or "
                "run out of actions." if max_steps else "")
  if action_format == "tool_call":  # The limit before the call's format, not after it.
    reply_format = f"{_TOOL_CALL_FORMAT}{limit_note}\n{base.TOOL_CALL_INSTRUCTION}"
    limit_note = ""
  else:
    reply_format = _REACT_FORMAT
  return _INSTRUCTION.format(viewport_note=viewport_note, limit_note=limit_note,
                             reply_format=reply_format)


class WebArenaEnv:
  """One WebArena episode at a time in a Chromium of its own (the `Env` protocol)."""

  name = "webarena"

  def __init__(self, config_dir: str | None = None, *, site_urls: Mapping[str, str] | None = None,
               max_steps: int = 30, num_test: int = 50, test_task_ids: Sequence[int] | None = None,
               viewport_only: bool = True, viewport: Sequence[int] = (1280, 720),
               max_tree_chars: int | None = None, settle_s: float = 0.2, timeout_s: float = 30.0,
               executable: str = browser.DEFAULT_EXECUTABLE, action_format: str = "react"):
    """Loads the tasks; Chromium starts with the first episode.

    Args:
      config_dir: the directory of task configs; default $WEBARENA_CONFIG_DIR, else
        DEFAULT_CONFIG_DIR.
      site_urls: addresses of the sites, e.g. {"SHOPPING": "http://host:7770"}, for the
        configs' __SHOPPING__ placeholders (over the environment variables SITE_VARIABLES).
      max_steps: actions per episode before it is judged without an answer.
      num_test, test_task_ids: the test split (tasks.split).
      viewport_only: show only the part of the page in the viewport (WebArena's
        current_viewport_only, which AgentGym's server sets).
      viewport: the window size (width, height).
      max_tree_chars: cut longer trees (WebArena cuts at max_obs_length tokens); None keeps all.
      settle_s: time for an action's effects to begin before the page is observed.
      timeout_s: the limit of one page operation.
      executable: the Chromium binary (Debian's package by default).
      action_format: react or tool_call (environments/base.py; the tools are TOOLS).
    """
    if max_steps < 1:
      raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if max_tree_chars is not None and max_tree_chars < 1:
      raise ValueError(f"max_tree_chars must be None or >= 1, got {max_tree_chars}")
    if len(viewport) != 2:
      raise ValueError(f"viewport must be (width, height), got {viewport!r}")
    config_dir = config_dir or os.environ.get(CONFIG_DIR_VARIABLE) or DEFAULT_CONFIG_DIR
    self._tasks = tasks.load_tasks(config_dir)
    self._splits = tasks.split(self._tasks, num_test, test_task_ids)
    self._site_urls = {name: os.environ[name] for name in SITE_VARIABLES if os.environ.get(name)}
    self._site_urls.update(site_urls or {})
    self.max_steps = max_steps
    self.action_format = base.ActionFormat(action_format, TOOLS, react_reply)
    self._max_tree_chars = max_tree_chars
    self._browser = browser.Browser(executable, viewport=(int(viewport[0]), int(viewport[1])),
                                    viewport_only=viewport_only, settle_s=settle_s,
                                    timeout_s=timeout_s)
    self._config: dict[str, Any] | None = None  # the episode's task, placeholders resolved
    self._steps = 0

  @property
  def instruction(self) -> str:
    return instruction_text(self._browser.viewport_only, self.max_steps, self.action_format.kind)

  @property
  def browser(self) -> browser.Browser:
    return self._browser

  def task_ids(self, split: str) -> Sequence[int]:
    return self._splits[base.check_split(split)]

  def task_info(self, task_id: int) -> dict[str, Any]:
    return self._task(task_id).info()

  def reset(self, task_id: int) -> str:
    task = self._task(task_id)
    config = task.resolve(self._site_urls)
    self._config = None
    storage_state = config.get("storage_state") if config.get("require_login") else None
    self._browser.start_episode(config["start_url"].split(" |AND| "),
                                _storage_state_path(task, storage_state), config.get("geolocation"))
    self._config, self._steps = config, 0
    return self._observation("None")

  def step(self, action_text: str) -> StepResult:
    if self._config is None:
      raise RuntimeError("step() without an episode in progress; call reset() first")
    self._steps += 1
    at_limit = self._steps >= self.max_steps
    try:
      action = actions.parse_reply(self.action_format.react_reply(action_text))
    except (ActionParseError, base.ToolCallError) as e:
      if at_limit:
        return self._finish("", f"the limit of {self.max_steps} actions was reached",
                            {"invalid_action": str(e)})
      observation = (str(e) if isinstance(e, base.ToolCallError) else
                     f"Invalid action: {e}. {actions.FORMAT_HINT}")
      return StepResult(observation, 0.0, False, {"success": False, "invalid_action": str(e)})
    if action.kind == "stop":
      return self._finish(action.answer, f"you stopped with the answer [{action.answer}]",
                          {"action": str(action)})
    described = self._describe(action)
    info: dict[str, Any] = {"success": False, "action": str(action)}
    try:
      self._browser.execute(action)
    except browser.ActionFailed as e:
      described += f" (failed: {e})"
      info["action_error"] = str(e)
    if at_limit:
      return self._finish("", f"the limit of {self.max_steps} actions was reached", info)
    return StepResult(self._observation(described), 0.0, False, info)

  def close(self) -> None:
    self._config = None
    self._browser.close()

  def _task(self, task_id: int) -> tasks.Task:
    if task_id not in self._tasks:
      raise ValueError(f"unknown WebArena task id {task_id!r}; the loaded ids run from "
                       f"{min(self._tasks)} to {max(self._tasks)}")
    return self._tasks[task_id]

  def _describe(self, action: Action) -> str:
    """The action as PREVIOUS ACTION shows it (WebArena's action history line)."""
    if action.kind not in actions.ELEMENT_KINDS:
      return str(action)
    element = self._browser.element_description(action.element_id)
    return f"{action} where [{action.element_id}] is {element}" if element else str(action)

  def _observation(self, previous_action: str) -> str:
    view = self._browser.observe()
    tree = view.tree
    if self._max_tree_chars is not None and len(tree) > self._max_tree_chars:
      tree = tree[:self._max_tree_chars].rpartition("\n")[0] + _TRUNCATED
    return (f"OBSERVATION:\n{view.tabs}\n\n{tree}\nURL: {view.url}\n"
            f"OBJECTIVE: {self._config['intent']}\nPREVIOUS ACTION: {previous_action}")

  def _finish(self, answer: str, reason: str, info: dict[str, Any]) -> StepResult:
    evaluation = self._browser.evaluate_task(self._config, answer)
    self._config = None
    info.update(success=evaluation.score == 1.0, answer=answer, scores=evaluation.scores)
    if evaluation.judge is not None:
      info["judge"] = evaluation.judge
    if evaluation.errors:
      info["eval_errors"] = list(evaluation.errors)
    return StepResult(f"The episode is over: {reason}.", evaluation.score, True, info)


def _storage_state_path(task: tasks.Task, storage_state: str | None) -> str | None:
  """A login state file; a relative path is WebArena's, from its repository root (the parent
  of the config file's directory)."""
  if not storage_state:
    return None
  path = os.path.expanduser(storage_state)
  if not os.path.isabs(path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(task.source)))
    path = os.path.join(root, path)
  if not os.path.isfile(path):
    raise base.EnvError(f"task {task.task_id}: login state {storage_state!r} not found at "
                        f"{path}; create it with WebArena's browser_env/auto_login.py")
  return path
