"""Expert demonstrations: conversations played through the real environments, verified by replay.

A demonstration is one conversation in the shape the rollout logs (`Trajectory.to_json`), plus
where it came from:

  {"task_id": int, "env": str, "category": str, "source": str,
   "reward": float, "success": bool, "num_turns": int,
   "messages": [{"role": "user", "content": instruction + "\\n\\n" + first observation},
                {"role": "assistant", "content": "Thought: ...\\n\\nAction: ..."},
                {"role": "user", "content": observation}, ...,
                {"role": "assistant", "content": last reply}]}

As in a rollout, the observation that answers the last reply is not part of the conversation.

An expert maps (env, task id) to the replies it would send. `demonstrate` then replays those
replies through a fresh episode of the same env and builds the conversation from what the env
says, so every kept demonstration is one the env itself scored a success; the others are
counted with the reason. Experts:

  textcraft_oracle  the planner of environments.textcraft.oracle, each action with a short
                    thought derived from the plan ("I need oak planks for the crafting table,
                    so I craft them from oak logs.").
  babyai_bot        minigrid's BabyAIBot plays the level primitive by primitive; its trace is
                    then shortened into our high-level actions ("pick up red ball 1") wherever
                    one reaches a later state of the trace in no more primitive steps, so
                    demonstrations fit the paper's 6-20 turn horizons. The thoughts say the
                    bot's subgoals.
  sciworld_gold     ScienceWorld's gold action sequence, each action with a thought of its verb.
  rollout replies   `from_rollouts`: the replies of logged trajectories, filtered by reward and
                    success, replayed like the rest.

All of it is deterministic for a given environment version (ScienceWorld up to the simulator's
own nondeterminism, see environments/sciworld/env.py).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import re
import shutil
from typing import Any, Callable, Iterable, Mapping, Sequence

from environments import base

Record = dict[str, Any]
# An expert: (env, task_id) -> the replies it sends, in order. It may play the env to find them.
Expert = Callable[[base.Env, int], list[str]]

ORACLE, BOT, GOLD, ROLLOUT = "textcraft_oracle", "babyai_bot", "sciworld_gold", "rollout"
# Rewards summed in floating point (SciWorld: score differences / 100) may miss a threshold by
# rounding, e.g. 0.9999999999999999 for a full score.
_REWARD_TOLERANCE = 1e-6


def reply(thought: str, action: str) -> str:
  """A reply in the format every environment's instruction asks for."""
  return f"Thought: {thought}\n\nAction: {action}"


# --- verification --------------------------------------------------------------------------


def replay(env: base.Env, task_id: int, replies: Sequence[str], *, source: str
           ) -> tuple[Record, str]:
  """Plays `replies` in a fresh episode of `task_id`: (conversation record, failure reason).

  The reason is "" when the episode ends in success. Replies after the episode ends are
  dropped (a gold path may run past its winning action).
  """
  first = env.reset(task_id)
  messages = [{"role": "user", "content": f"{env.instruction}\n\n{first}"}]
  rewards: list[float] = []
  result = None
  for text in replies:
    if result is not None:
      messages.append({"role": "user", "content": result.observation})
    result = env.step(text)
    messages.append({"role": "assistant", "content": text})
    rewards.append(float(result.reward))
    if result.done:
      break
  success = bool(result is not None and result.done and result.info.get("success", False))
  if result is None:
    reason = "no replies"
  elif not result.done:
    reason = f"not done after {len(replies)} {'reply' if len(replies) == 1 else 'replies'}"
  elif not success:
    reason = "done without success"
  else:
    reason = ""
  record = {"task_id": int(task_id), "env": env.name,
            "category": str(env.task_info(task_id).get("category", "all")), "source": source,
            "reward": float(sum(rewards)), "success": success, "num_turns": len(rewards),
            "messages": messages}
  return record, reason


@dataclasses.dataclass
class Demonstrations:
  """Verified demonstrations and the tasks that gave none, with why."""

  demos: list[Record] = dataclasses.field(default_factory=list)
  rejected: list[tuple[int, str]] = dataclasses.field(default_factory=list)

  def rejection_counts(self) -> dict[str, int]:
    """Number of rejected tasks per reason (task-specific numbers folded into "N")."""
    return dict(collections.Counter(re.sub(r"\b\d+\b", "N", reason) for _, reason in self.rejected))

  def summary(self) -> str:
    kept = len(self.demos)
    turns = sum(d["num_turns"] for d in self.demos) / kept if kept else 0.0
    lines = [f"kept {kept} of {kept + len(self.rejected)} demonstrations "
             f"(mean {turns:.1f} turns)"]
    lines += [f"  rejected {n}: {reason}" for reason, n in sorted(self.rejection_counts().items())]
    return "\n".join(lines)


def demonstrate(env: base.Env, task_id: int, expert: Expert, source: str, *,
                require_success: bool = True, min_reward: float | None = None
                ) -> tuple[Record | None, str]:
  """The expert's verified demonstration of one task: (record, "") or (None, reason).

  Verified means the replay succeeds (if `require_success`) and earns at least `min_reward`
  (if given, up to float rounding: SciWorld's step rewards are score differences / 100).
  """
  try:
    replies = expert(env, task_id)
  except (base.EnvError, ExpertError) as error:
    return None, f"expert failed: {error}"
  try:
    record, reason = replay(env, task_id, replies, source=source)
  except base.EnvError as error:
    return None, f"replay failed: {error}"
  if not record["num_turns"]:
    return None, "no replies"
  if require_success and reason:
    return None, reason
  if min_reward is not None and record["reward"] < min_reward - _REWARD_TOLERANCE:
    return None, f"replay earned less than min_reward {min_reward:g}"
  return record, ""


def expert_for(env_name: str) -> tuple[str, Expert]:
  """(source name, expert) of an environment; ValueError if it has none or cannot run here."""
  if env_name not in EXPERTS:
    raise ValueError(f"no expert for environment {env_name!r}; experts exist for "
                     f"{sorted(EXPERTS)} (other environments: use from_rollouts)")
  if env_name == "sciworld":
    if importlib.util.find_spec("scienceworld") is None:
      raise ValueError("SciWorld gold paths need the `scienceworld` package (pip install "
                       "scienceworld); skipping SciWorld demonstrations")
    if shutil.which("java") is None:
      raise ValueError("SciWorld gold paths need Java (e.g. apt-get install "
                       "openjdk-17-jre-headless); skipping SciWorld demonstrations")
  return EXPERTS[env_name]


def collect(env: base.Env, task_ids: Iterable[int], *, expert: Expert | None = None,
            source: str | None = None) -> Demonstrations:
  """Verified demonstrations of `task_ids` by `expert` (default: `expert_for(env.name)`)."""
  if expert is None:
    source, expert = expert_for(env.name)
  source = source or getattr(expert, "__name__", "expert")
  result = Demonstrations()
  for task_id in task_ids:
    record, reason = demonstrate(env, task_id, expert, source)
    if record is None:
      result.rejected.append((int(task_id), reason))
    else:
      result.demos.append(record)
  return result


def from_rollouts(records: Iterable[Mapping[str, Any]], env: base.Env, *,
                  min_reward: float = 1.0, require_success: bool = True) -> Demonstrations:
  """Logged trajectories (e.g. `metrics.read_trajectories(workdir)`) as verified demonstrations.

  Keeps those with reward >= `min_reward` (and success, if `require_success`), one per distinct
  reply sequence of a task, in input order, and replays their replies through `env`; the replay
  must pass the same filter. The conversation is rebuilt from the replay, so its prompt and
  observations are the env's current ones.
  """
  result = Demonstrations()
  seen: set[tuple[int, tuple[str, ...]]] = set()
  for index, record in enumerate(records):
    task_id, replies = _rollout_replies(record, index)
    if float(record.get("reward", 0.0)) < min_reward - _REWARD_TOLERANCE or (
        require_success and not record.get("success", False)):
      continue
    if (task_id, replies) in seen:
      continue
    seen.add((task_id, replies))
    demo, reason = demonstrate(env, task_id, lambda *_: list(replies), ROLLOUT,
                               require_success=require_success, min_reward=min_reward)
    if demo is None:
      result.rejected.append((task_id, reason))
    else:
      result.demos.append(demo)
  return result


def _rollout_replies(record: Mapping[str, Any], index: int) -> tuple[int, tuple[str, ...]]:
  try:
    task_id = record["task_id"]
    messages = record["messages"]
    replies = tuple(m["content"] for m in messages if m["role"] == "assistant")
  except (KeyError, TypeError) as error:
    raise ValueError(f"trajectory record {index} lacks task_id or role/content messages: "
                     f"{error!r}") from error
  if isinstance(task_id, bool) or not isinstance(task_id, int):
    raise ValueError(f"trajectory record {index} has task_id {task_id!r}, not an int")
  return task_id, replies


# --- TextCraft -----------------------------------------------------------------------------

_GET = re.compile(r"get (\d+) (.+)")
_CRAFT = re.compile(r"craft (\d+) (.+?) using (.+)")
_GOAL = re.compile(r"Goal: craft (.+)\.\s*$")


class ExpertError(RuntimeError):
  """An expert could not produce replies for a task."""


def textcraft_oracle(env: base.Env, task_id: int) -> list[str]:
  """The TextCraft oracle's plan, each action with a thought derived from the plan.

  The env is only reset (the oracle reads the first observation, as an agent would).
  """
  from environments.textcraft import oracle  # pylint: disable=import-outside-toplevel
  first = env.reset(task_id)
  goal = _GOAL.search(first)
  if goal is None:
    raise ExpertError(f"task {task_id}: no goal line in {first[-200:]!r}")
  actions = oracle.solve(first)
  return [reply(textcraft_thought(actions, i, goal.group(1)), action)
          for i, action in enumerate(actions)]


def textcraft_thought(actions: Sequence[str], index: int, goal: str) -> str:
  """A one-sentence reason for actions[index] of an oracle plan for `goal`.

  The item an action makes is wanted by the first later craft that lists it as an ingredient
  (its "user"), which needs (count in the user's command) x (times the user's command is
  repeated in a row) of it; the goal's own craft ends the episode. For the plan
    0 get 2 oak logs                        "To craft the oak planks I need 2 oak logs, which I
                                             can get directly, so I get 2."
    1 craft 4 oak planks using 1 oak logs   "To craft the chest I need 8 oak planks, which I
                                             craft from oak logs."
    2 craft 4 oak planks using 1 oak logs   "I have 4 of the 8 oak planks for the chest, so I
                                             craft again."
    3 craft 1 chest using 8 oak planks      "I have everything for the chest, so I craft it to
                                             reach the goal."
  """
  action = actions[index]
  if match := _GET.fullmatch(action):
    count, item = match.groups()
    user = _textcraft_user(actions, index, item)
    if user is None:
      return f"I can get {item} directly, so I get {count}."
    return (f"To craft the {user[0]} I need {user[1]} {item}, which I can get directly, "
            f"so I get {count}.")
  match = _CRAFT.fullmatch(action)
  if match is None:
    raise ExpertError(f"the oracle planned {action!r}, neither get nor craft")
  made_per_craft, target, inputs = match.groups()
  if target == goal:
    return f"I have everything for the {goal}, so I craft it to reach the goal."
  user = _textcraft_user(actions, index, target)
  repeats = _run_length(actions[index::-1])
  if repeats > 1 and user is not None:
    made = int(made_per_craft) * (repeats - 1)
    return f"I have {made} of the {user[1]} {target} for the {user[0]}, so I craft again."
  ingredients = " and ".join(part.partition(" ")[2] for part in inputs.split(", "))
  if user is None:
    return f"I craft {target} from {ingredients}."
  return f"To craft the {user[0]} I need {user[1]} {target}, which I craft from {ingredients}."


def _textcraft_user(actions: Sequence[str], index: int, item: str) -> tuple[str, int] | None:
  """(target, count of `item` it needs) of the first craft after actions[index] using `item`."""
  for position in range(index + 1, len(actions)):
    match = _CRAFT.fullmatch(actions[position])
    if match is None:
      continue
    for part in match.group(3).split(", "):
      count, _, name = part.partition(" ")
      if name == item:
        return match.group(2), int(count) * _run_length(actions[position:])
  return None


def _run_length(actions: Sequence[str]) -> int:
  """How many times actions[0] repeats at the start of `actions`."""
  return next((i for i, action in enumerate(actions) if action != actions[0]), len(actions))


# --- BabyAI --------------------------------------------------------------------------------

# minigrid's primitive actions (minigrid.core.actions.Actions) and our text actions for them.
_LEFT, _RIGHT, _FORWARD, _PICKUP, _DROP, _TOGGLE = range(6)
_PRIMITIVE_TEXT = {_LEFT: "turn left", _RIGHT: "turn right", _FORWARD: "move forward",
                   _PICKUP: "pick up", _DROP: "drop", _TOGGLE: "toggle"}
_HIGH_LEVEL_VERBS = ("go to", "pick up", "go through", "toggle and go through")
# Headings as minigrid's agent_dir: 0 = +x, 1 = +y, 2 = -x, 3 = -y.
_DIRECTION = ((1, 0), (0, 1), (-1, 0), (0, -1))


def babyai_bot(env: base.Env, task_id: int, *, max_primitives: int = 1000,
               high_level: bool = True) -> list[str]:
  """BabyAIBot's solution of a BabyAI task as replies (see the module docstring).

  Args:
    env: a BabyAIEnv (the bot reads its `minigrid_env`).
    task_id: the task.
    max_primitives: the bot gives up after this many primitive steps.
    high_level: shorten the bot's primitive trace into high-level actions where they reach the
      same state (position, heading, grid, carried object and mission progress) in no more
      steps; a trace that cannot be shortened that way keeps its primitive actions.
  """
  from minigrid.utils.baby_ai_bot import BabyAIBot  # pylint: disable=import-outside-toplevel
  env.reset(task_id)
  level = env.minigrid_env
  mission = level.mission
  bot = BabyAIBot(level)
  primitives: list[int] = []
  thoughts: list[str] = []
  states = [_babyai_state(level)]
  result = None
  while result is None or not result.done:
    if len(primitives) == max_primitives:
      raise ExpertError(f"the bot did not finish within {max_primitives} primitive steps")
    try:
      primitive = bot.replan()
    except Exception as error:  # The bot asserts when it cannot solve a level (KeyInBox).
      raise ExpertError(f"BabyAIBot failed: {error!r}") from error
    if int(primitive) not in _PRIMITIVE_TEXT:
      raise ExpertError(f"the bot chose {primitive!r} with the task not done")
    thoughts.append(_bot_thought(bot, level))
    result = env.step(reply(thoughts[-1], _PRIMITIVE_TEXT[int(primitive)]))
    if not result.info.get("valid_action", True):
      raise ExpertError(f"the env refused the bot's {_PRIMITIVE_TEXT[int(primitive)]!r}: "
                        f"{result.observation.splitlines()[0]}")
    primitives.append(int(primitive))
    states.append(_babyai_state(level))
  first_turn = f"My mission is to {mission}. "
  replies = [reply(t, _PRIMITIVE_TEXT[p]) for t, p in zip(thoughts, primitives)]
  if high_level:
    replies = _shorten(env, task_id, primitives, thoughts, states) or replies
  return [_prefixed(replies[0], first_turn), *replies[1:]]


def _prefixed(text: str, prefix: str) -> str:
  return text.replace("Thought: ", "Thought: " + prefix, 1)


def _shorten(env: base.Env, task_id: int, primitives: Sequence[int], thoughts: Sequence[str],
             states: Sequence[tuple]) -> list[str] | None:
  """The bot's trace in high-level actions where possible; None if a step does not reproduce.

  From trace state i, every available high-level action is tried on a copy of the level; one
  that reaches trace state j > i + 1 in at most j - i primitives (or ends the episode in
  success) replaces primitives[i:j]; the one reaching furthest wins, ties going to fewer
  primitives and then to the order of the available-actions list.
  """
  from environments.babyai import actions as actions_lib  # pylint: disable=import-outside-toplevel
  from environments.babyai import scene as scene_lib  # pylint: disable=import-outside-toplevel
  end = len(primitives)
  later = collections.defaultdict(list)  # state -> trace indices where it occurs
  for index, state in enumerate(states):
    later[state].append(index)
  places = {(s[0], s[1]) for s in states}
  env.reset(task_id)
  replies, i = [], 0
  while i < end:
    level = env.minigrid_env
    scene = scene_lib.observe(level)
    best: tuple[int, int, str] | None = None  # (reached index, -primitives, action)
    for action in actions_lib.available(scene):
      if not action.startswith(_HIGH_LEVEL_VERBS) or action == "pick up":
        continue
      steps = actions_lib.expand(actions_lib.parse(action), scene)
      if _final_place(level, steps) not in places:
        continue  # cheap filter: it ends somewhere the bot never stood
      reached = _reached(level, steps, later, i, success_index=end + 1)
      if reached is not None and reached > i + 1 and (
          best is None or (reached, -len(steps)) > best[:2]):
        best = (reached, -len(steps), action)
    if best is None:
      j, action = i + 1, _PRIMITIVE_TEXT[primitives[i]]
    else:
      j, _, action = best
    thought = " ".join(dict.fromkeys(thoughts[i:j]))  # distinct subgoals, in order
    result = env.step(reply(thought, action))
    replies.append(reply(thought, action))
    if result.done:
      return replies if result.info.get("success") else None
    if j > end or _babyai_state(env.minigrid_env) != states[j]:
      return None
    i = j
  return None


def _final_place(level, steps: Sequence[int]) -> tuple[tuple[int, int], int]:
  """Where (position, heading) `steps` leave the agent, if every forward step succeeds."""
  (x, y), heading = tuple(int(v) for v in level.agent_pos), int(level.agent_dir)
  for step in steps:
    if step == _LEFT:
      heading = (heading - 1) % 4
    elif step == _RIGHT:
      heading = (heading + 1) % 4
    elif step == _FORWARD:
      x, y = x + _DIRECTION[heading][0], y + _DIRECTION[heading][1]
  return (x, y), heading


def _reached(level, steps: Sequence[int], later: Mapping[tuple, list[int]], start: int, *,
             success_index: int) -> int | None:
  """The furthest trace index after `start` whose state `steps` reach from the level's state
  in at most as many primitives; `success_index` if they end the episode in success."""
  trial = copy.deepcopy(level)
  reward, terminated, truncated = 0.0, False, False
  for step in steps:
    _, reward, terminated, truncated, _ = trial.step(step)
    if terminated or truncated:
      break
  if terminated and reward > 0:
    return success_index
  if terminated or truncated:
    return None
  candidates = [j for j in later.get(_babyai_state(trial), ()) if j - start >= len(steps)]
  return max(candidates, default=None)


def _babyai_state(level) -> tuple:
  """What the rest of an episode depends on: the agent, the grid, the carried object and the
  mission's progress (minigrid's step count only changes the reward)."""
  carrying = level.carrying
  return ((int(level.agent_pos[0]), int(level.agent_pos[1])), int(level.agent_dir),
          None if carrying is None else (carrying.type, carrying.color),
          level.grid.encode().tobytes(), _mission_progress(level.instrs))


def _mission_progress(instr) -> Any:
  if hasattr(instr, "instr_a"):  # before / after / and: two sub-instructions
    return (instr.a_done, instr.b_done, _mission_progress(instr.instr_a),
            _mission_progress(instr.instr_b))
  return getattr(instr, "lastStepMatch", None)


def _bot_thought(bot, level) -> str:
  """The bot's current subgoal (top of its stack after replanning), as a sentence."""
  if not bot.stack:
    return "The mission is nearly done."
  subgoal = bot.stack[-1]
  kind = type(subgoal).__name__
  if kind == "GoNextToSubgoal":
    if subgoal.reason == "Explore":
      return "I have not seen everything I need yet, so I explore."
    target = _describe(subgoal.datum, level)
    return f"I go next to {target}." if target else "I move out of the way."
  if kind == "ExploreSubgoal":
    return "I have not seen everything I need yet, so I explore."
  if kind == "OpenSubgoal":
    return "I open the door in front of me."
  if kind == "CloseSubgoal":
    return "I close the door in front of me."
  if kind == "PickupSubgoal":
    front = level.grid.get(*level.front_pos)
    return f"I pick up the {front.color} {front.type}." if front else "I pick up what is ahead."
  if kind == "DropSubgoal":
    held = level.carrying
    return f"I put down the {held.color} {held.type}." if held else "I put down what I carry."
  return "I follow my plan."


def _describe(datum, level) -> str | None:
  """"the red ball" for an object description, an object, or a cell holding an object."""
  color, kind = getattr(datum, "color", None), getattr(datum, "type", None)
  if kind is None and not hasattr(datum, "color"):  # a position
    cell = level.grid.get(int(datum[0]), int(datum[1]))
    if cell is None or cell.type in ("wall", "floor"):
      return None
    color, kind = cell.color, cell.type
  return "the " + " ".join(part for part in (color, kind or "object") if part)


# --- SciWorld ------------------------------------------------------------------------------

# (action prefix, thought template over the rest of the action), first match wins.
_SCIWORLD_THOUGHTS = (
    ("look around", "I look around to see what is here."),
    ("look at ", "I examine the {}."),
    ("look in ", "I check what is inside the {}."),
    ("read ", "I read the {}."),
    ("open door to ", "The way to the {} is through this door, so I open it."),
    ("open ", "I open the {}."),
    ("close ", "I close the {}."),
    ("go to ", "I go to the {}."),
    ("pick up ", "I need the {}, so I pick it up."),
    ("put down ", "I put down the {}."),
    ("move ", "I move the {}."),
    ("pour ", "I pour the {}."),
    ("dunk ", "I dunk the {}."),
    ("mix ", "I mix what is in the {}."),
    ("activate ", "I turn on the {}."),
    ("deactivate ", "I turn off the {}."),
    ("use ", "I use the {}."),
    ("connect ", "I connect the {}."),
    ("disconnect ", "I disconnect the {}."),
    ("eat ", "I eat the {}."),
    ("flush ", "I flush the {}."),
    ("focus on ", "The task is about the {}, so I focus on it."),
    ("wait", "I let time pass for the process to go on."),
    ("inventory", "I check what I am carrying."),
    ("task", "I read the task again."),
)


def sciworld_gold(env: base.Env, task_id: int) -> list[str]:
  """ScienceWorld's gold action sequence for the task, each action with a verb's thought."""
  gold_actions = getattr(env, "gold_actions", None)
  if gold_actions is None:
    raise ExpertError(f"{type(env).__name__} has no gold_actions (needs the SciWorld adapter)")
  return [reply(sciworld_thought(action), action) for action in gold_actions(task_id)]


def sciworld_thought(action: str) -> str:
  """A sentence for a ScienceWorld action: "move X to Y" -> "I move the X to Y."."""
  if action.isdigit():
    return f"Several things match my action; I choose option {action}."
  for prefix, template in _SCIWORLD_THOUGHTS:
    if action == prefix.strip() or action.startswith(prefix):
      rest = action[len(prefix):]
      rest = re.sub(r" (to|in|on|into) ", r" \1 the ", rest, count=1)
      return template.format(rest)
  return "This is the next step of my plan."


EXPERTS: dict[str, tuple[str, Expert]] = {
    "textcraft": (ORACLE, textcraft_oracle),
    "babyai": (BOT, babyai_bot),
    "sciworld": (GOLD, sciworld_gold),
}
