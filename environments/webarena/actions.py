"""WebArena's action grammar: the action in a model reply, parsed into an `Action`.

A reply carries one action between triple backticks; the first fenced span is the action (as
WebArena's chain-of-thought prompt constructor and AgentGym's WebArena server extract it):

  Let's think step by step. ... In summary, the next action I will perform is ```click [12]```

The actions (WebArena's id-based action space over the accessibility tree; ids are the numbers
in brackets at the start of the observation's lines):

  click [id]                                  click the element's centre
  type [id] [content] [press_enter_after=0|1] click the element, type content; Enter follows
                                              unless the flag is 0 (the flag is optional)
  hover [id]                                  move the mouse over the element
  press [key_comb]                            e.g. Enter, Control+a, Shift+Tab
  scroll [direction=down|up]                  scroll by one window height
  new_tab / tab_focus [tab_index] / close_tab
  goto [url] / go_back / go_forward
  stop [answer]                               end the episode; the answer may be empty

Parsing follows WebArena's `create_id_based_action`: the action name is the text before the
first "[" (or the first word), brackets hold the arguments, and the last bracket of goto, press
and stop closes the argument (so "stop [a [b] c]" answers "a [b] c"). It is more lenient in
ways that do not change the meaning of anything WebArena accepts: names are case-insensitive,
"direction=" and "press_enter_after=" may be written out as in the grammar line, typed content
may span lines, and key names are matched case-insensitively (ctrl, alt, shift, esc and the
arrow keys included). Meta (Cmd) becomes Control, as WebArena does off macOS; our browser is
always Linux Chromium.

Anything else raises ActionParseError, whose message tells the model what was wrong.
"""

from __future__ import annotations

import dataclasses
import re

KINDS = ("click", "type", "hover", "press", "scroll", "new_tab", "tab_focus", "close_tab", "goto",
         "go_back", "go_forward", "stop")
ELEMENT_KINDS = frozenset({"click", "type", "hover"})

_FENCED = re.compile(r"```(.*?)```", re.DOTALL)
_FLAGS = re.IGNORECASE | re.DOTALL
_ELEMENT = {kind: re.compile(rf"{kind} ?\[(\d+)\]", _FLAGS) for kind in ("click", "hover")}
_TYPE_WITH_FLAG = re.compile(r"type ?\[(\d+)\] ?\[(.*)\] ?\[(?:press_enter_after=)?([01])\]",
                             _FLAGS)
_TYPE = re.compile(r"type ?\[(\d+)\] ?\[(.*)\]", _FLAGS)
_PRESS = re.compile(r"press ?\[(.+)\]", _FLAGS)
_SCROLL = re.compile(r"scroll ?\[?(?:direction=)?(up|down)\]?", _FLAGS)
_TAB_FOCUS = re.compile(r"tab_focus ?\[(\d+)\]", _FLAGS)
_GOTO = re.compile(r"goto ?\[(.+)\]", _FLAGS)
_STOP = re.compile(r"stop ?\[(.*)\]", _FLAGS)

# Playwright's names of the keys a model may spell in lower case.
_KEY_NAMES = {
    **{
        name.lower(): name
        for name in ("Backquote", "Minus", "Equal", "Backslash", "Backspace", "Tab", "Delete",
                     "Escape", "ArrowDown", "ArrowUp", "ArrowLeft", "ArrowRight", "End", "Enter",
                     "Home", "Insert", "PageDown", "PageUp", "Space", "Control", "Alt", "Shift")
    },
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
    "ctrl": "Control",
    "esc": "Escape",
    "return": "Enter",
    "meta": "Control",
    "cmd": "Control",
    "command": "Control",
    "up": "ArrowUp",
    "down": "ArrowDown",
    "left": "ArrowLeft",
    "right": "ArrowRight",
}

FORMAT_HINT = ("Reply with exactly one action inside triple backticks, e.g. "
               "```click [12]``` or ```stop [answer]```.")


class ActionParseError(ValueError):
  """A reply without a well-formed action; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class Action:
  """One parsed action; only the fields of its kind are set.

  Attributes:
    kind: one of KINDS.
    element_id: the observation id of click, type and hover.
    text: what type types (without the Enter).
    press_enter: whether type presses Enter afterwards.
    key_comb: press's keys in Playwright's syntax ("Control+a").
    direction: "up" or "down" for scroll.
    tab_index: tab_focus's tab.
    url: goto's address.
    answer: stop's answer.
  """

  kind: str
  element_id: str = ""
  text: str = ""
  press_enter: bool = False
  key_comb: str = ""
  direction: str = ""
  tab_index: int = 0
  url: str = ""
  answer: str = ""

  def __str__(self) -> str:
    """The action written back in the grammar (WebArena's `action2str` without the element)."""
    match self.kind:
      case "click" | "hover":
        return f"{self.kind} [{self.element_id}]"
      case "type":
        return f"type [{self.element_id}] [{self.text}] [{int(self.press_enter)}]"
      case "press":
        return f"press [{self.key_comb}]"
      case "scroll":
        return f"scroll [{self.direction}]"
      case "tab_focus":
        return f"tab_focus [{self.tab_index}]"
      case "goto":
        return f"goto [{self.url}]"
      case "stop":
        return f"stop [{self.answer}]"
      case _:
        return self.kind


def extract_action_text(reply: str) -> str:
  """The text of the first ```fenced``` span of a reply, stripped."""
  match = _FENCED.search(reply)
  if match is None:
    raise ActionParseError("no action found between triple backticks")
  text = match.group(1).strip()
  if not text:
    raise ActionParseError("the triple backticks hold no action")
  return text


def parse_reply(reply: str) -> Action:
  """The action of a whole model reply (module docstring)."""
  return parse_action(extract_action_text(reply))


def parse_action(text: str) -> Action:
  """Parses one action written in the grammar of the module docstring."""
  text = text.strip()
  name = (text.split("[", 1)[0] if "[" in text else text.split(maxsplit=1)[0] if text else "")
  name = name.strip().lower()
  match name:
    case "click" | "hover":
      return Action(name, element_id=_group(_ELEMENT[name], text, f"{name} [id]"))
    case "type":
      return _parse_type(text)
    case "press":
      return Action("press", key_comb=_key_comb(_group(_PRESS, text, "press [key_comb]")))
    case "scroll":
      return Action("scroll", direction=_group(_SCROLL, text,
                                               "scroll [down] or scroll [up]").lower())
    case "tab_focus":
      return Action("tab_focus", tab_index=int(_group(_TAB_FOCUS, text, "tab_focus [index]")))
    case "goto":
      return Action("goto", url=_group(_GOTO, text, "goto [url]").strip())
    case "new_tab" | "close_tab" | "go_back" | "go_forward":
      return Action(name)
    case "stop":
      match = _STOP.match(text)
      return Action("stop", answer=match.group(1).strip() if match else "")
  shown = name if len(name) <= 40 else name[:40] + "..."
  raise ActionParseError(f"unknown action {shown!r}; the actions are {', '.join(KINDS)}")


def _group(pattern: re.Pattern[str], text: str, usage: str) -> str:
  match = pattern.match(text)
  if match is None:
    raise ActionParseError(f"malformed action; write it as {usage}")
  return match.group(1)


def _parse_type(text: str) -> Action:
  match = _TYPE_WITH_FLAG.fullmatch(text)
  if match is not None:
    element_id, content, flag = match.groups()
  else:
    match = _TYPE.fullmatch(text)
    if match is None:
      raise ActionParseError("malformed action; write it as type [id] [content] "
                             "[press_enter_after=0|1]")
    (element_id, content), flag = match.groups(), "1"
  if not content:
    raise ActionParseError("type needs something to type: type [id] [content]")
  return Action("type", element_id=element_id, text=content, press_enter=flag == "1")


def _key_comb(spelled: str) -> str:
  keys = [key.strip() for key in spelled.split("+")]
  if not all(keys):
    raise ActionParseError(f"malformed key combination {spelled!r}; e.g. press [Control+a]")
  return "+".join(_KEY_NAMES.get(key.lower(), key) for key in keys)
