"""Expert demonstrations: conversations played through the real environments, verified by replay.

A demonstration is one conversation in the shape the rollout logs (`Trajectory.to_json`), plus
where it came from:

  {"task_id": int, "env": str, "category": str, "source": str,
   "reward": float, "success": bool, "num_turns": int,
   "messages": [{"role": "user", "content": instruction + "\\n\\n" + first observation},
                {"role": "assistant", "content": "Thought: ...\\n\\nAction: ..."},
                {"role": "user", "content": observation}, ...,
                {"role": "assistant", "content": last reply}],
   "tools": [JSON schema, ...]}   (only in the tool_call action format)

As in a rollout, the observation that answers the last reply is not part of the conversation.
The replies are in the env's action format (environments/base.py): an env made with
action_format="tool_call" gets its experts' actions as tool calls, and the record carries the
tools the conversation is rendered with.

An expert maps (env, task id) to the replies it would send. `demonstrate` then replays those
replies through a fresh episode of the same env and builds the conversation from what the env
says, so every kept demonstration is one the env itself scored a success; the others are
counted with the reason. Experts, each beside its environment (environments/<env>/expert.py):

  textcraft_oracle  TextCraft's planner, each action with a thought derived from the plan.
  babyai_bot        minigrid's BabyAIBot, its trace shortened into our high-level actions.
  sciworld_gold     ScienceWorld's gold action sequence, each action with a thought of its verb.
  searchqa_hops     SearchQA's generated questions: a search for each page of the question's
                    hops, then the gold answer.
  rollout replies   `from_rollouts`: the replies of logged trajectories, filtered by reward and
                    success, replayed like the rest.

All of it is deterministic for a given environment version (ScienceWorld up to the simulator's
own nondeterminism, see environments/sciworld/env.py).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import re
import shutil
from typing import Any, Callable, Iterable, Mapping, Sequence

from environments import base
from environments.babyai import expert as babyai_expert
from environments.sciworld import expert as sciworld_expert
from environments.searchqa import expert as searchqa_expert
from environments.textcraft import expert as textcraft_expert

Record = dict[str, Any]
# An expert: (env, task_id) -> the replies it sends, in order. It may play the env to find them.
Expert = Callable[[base.Env, int], list[str]]

ORACLE, BOT, GOLD, HOPS, ROLLOUT = ("textcraft_oracle", "babyai_bot", "sciworld_gold",
                                    "searchqa_hops", "rollout")
# Rewards summed in floating point (SciWorld: score differences / 100) may miss a threshold by
# rounding, e.g. 0.9999999999999999 for a full score.
_REWARD_TOLERANCE = 1e-6

# --- verification --------------------------------------------------------------------------


def replay(env: base.Env, task_id: int, replies: Sequence[str], *,
           source: str) -> tuple[Record, str]:
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
  record = {
      "task_id": int(task_id), "env": env.name,
      "category": str(env.task_info(task_id).get("category", "all")), "source": source,
      "reward": float(sum(rewards)), "success": success, "num_turns": len(rewards),
      "messages": messages
  }
  tools = base.tools_of(env)
  if tools is not None:
    record["tools"] = tools
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
    lines = [
        f"kept {kept} of {kept + len(self.rejected)} demonstrations "
        f"(mean {turns:.1f} turns)"
    ]
    lines += [f"  rejected {n}: {reason}" for reason, n in sorted(self.rejection_counts().items())]
    return "\n".join(lines)


def demonstrate(env: base.Env, task_id: int, expert: Expert, source: str, *,
                require_success: bool = True,
                min_reward: float | None = None) -> tuple[Record | None, str]:
  """The expert's verified demonstration of one task: (record, "") or (None, reason).

  Verified means the replay succeeds (if `require_success`) and earns at least `min_reward`
  (if given, up to float rounding: SciWorld's step rewards are score differences / 100).
  """
  try:
    replies = expert(env, task_id)
  except (base.EnvError, base.ExpertError) as error:
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


def demonstrate_tasks(env: base.Env, task_ids: Iterable[int], *, expert: Expert | None = None,
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


def from_rollouts(records: Iterable[Mapping[str, Any]], env: base.Env, *, min_reward: float = 1.0,
                  require_success: bool = True) -> Demonstrations:
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
    if float(record.get(
        "reward", 0.0)) < min_reward - _REWARD_TOLERANCE or (require_success
                                                             and not record.get("success", False)):
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


EXPERTS: dict[str, tuple[str, Expert]] = {
    "textcraft": (ORACLE, textcraft_expert.replies),
    "babyai": (BOT, babyai_expert.replies),
    "sciworld": (GOLD, sciworld_expert.replies),
    "searchqa": (HOPS, searchqa_expert.replies),
}
