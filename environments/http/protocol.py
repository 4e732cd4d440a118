"""The AgentGym HTTP protocol: routes, and the payload style of each environment.

AgentGym's environment servers share five routes but differ in their payloads; PROTOCOL.md
beside this file gives the contract route by route. In short (ID is "id", or "env_idx" in the
SearchQA and WebArena styles; TASK is "data_idx", "id" in SearchQA, "idx" in WebArena):

  POST /create  {}                   -> TextCraft: {id, observation, done, reward} (an episode
                                        starts); BabyAI/SciWorld: {id}; SearchQA: the bare id;
                                        WebArena: {env_idx}
  POST /reset   {ID, TASK}           -> {observation, reward, done, ...}; SearchQA: the bare
                                        observation; WebArena: {observation, sites, object}
  POST /step    {ID, action}         -> {observation, reward, done} (+ "score" in the score
                                        styles; WebArena: "terminated", "truncated")
  GET  /observation?ID=              -> the current observation (BabyAI: an object)
  POST /close   {ID}                 -> true, or false for an unknown id (WebArena: {closed})

As in the original servers, a request that is well formed but names an unknown env, an unknown
task, or an env whose episode has finished is answered 200 with {"error": "...", "code": "..."}
(the original clients assert status 200 and read on). Our server adds what an adapter knows
without an episode, so that a remote environment is a complete `Env` (original AgentGym servers
answer these with 404):

  GET /instruction                   -> {instruction}
  GET /task_ids?split=               -> {split, task_ids}
  GET /task_info?data_idx=           -> the task's metadata

In the score styles "score" is the episode's running total in the environment's own units
(BabyAI: the sum of minigrid rewards; SciWorld: 0-100 points, -100 on failure), and the original
clients train on it. Our adapters report per-step rewards whose sum is the episode's outcome on a
0-1 scale, a failure counting as 0 (SciWorld: max(score, 0) / 100; see environments/base.py), so
the two sides convert with

  score_t = score_scale * (r_1 + ... + r_t)   (or the adapter's own info["score"]),
  r_t = (max(score_t, 0) - max(score_{t-1}, 0)) / score_scale.

The style is a property of the environment name (`STYLES`); names not in the table use the
TextCraft style, which carries per-step rewards only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class PayloadStyle:
  """How one family of AgentGym servers shapes its payloads.

  Attributes:
    name: the environment whose server defined the style.
    create_returns_observation: /create starts an episode and returns its first observation.
    score_scale: None if /step carries per-step rewards only; otherwise /step and /reset carry
      "score" = score_scale * (sum of normalised rewards so far).
    reset_has_task_description: /reset returns the task text apart from the observation, and
      the first observation is `task_description + "\n" + observation`.
    success: whether an episode succeeded, from its final total (the summed rewards, or the
      score); used only for servers whose /step does not say "success".
    id_field: the field (and /observation query parameter) carrying the env id.
    task_field: the /reset field carrying the task id.
    plays_after_done: /step after the episode's end goes on playing (TextCraft) instead of
      answering {"error": "... has finished."}.
    bare_create: /create answers the bare id (SearchQA).
    bare_reset: /reset answers the bare observation (SearchQA).
    gym_step: /step says "terminated" and "truncated" (WebArena), besides our "done".
    observation_object: GET /observation answers {observation, reward, score, done, deleted}
      (BabyAI) instead of the bare observation.
    close_object: /close answers {"closed": "closed"} (WebArena) instead of true.
  """

  name: str
  create_returns_observation: bool
  score_scale: float | None
  reset_has_task_description: bool
  success: Callable[[float], bool]
  id_field: str = "id"
  task_field: str = "data_idx"
  plays_after_done: bool = False
  bare_create: bool = False
  bare_reset: bool = False
  gym_step: bool = False
  observation_object: bool = False
  close_object: bool = False


TEXTCRAFT = PayloadStyle("textcraft", create_returns_observation=True, score_scale=None,
                         reset_has_task_description=False, success=lambda total: total >= 1.0,
                         plays_after_done=True)
# minigrid pays 1 - 0.9 * steps / max_steps >= 0.1 on success and 0 otherwise.
BABYAI = PayloadStyle("babyai", create_returns_observation=False, score_scale=1.0,
                      reset_has_task_description=False, success=lambda score: score > 0.0,
                      observation_object=True)
SCIWORLD = PayloadStyle("sciworld", create_returns_observation=False, score_scale=100.0,
                        reset_has_task_description=True, success=lambda score: score >= 100.0)
SEARCHQA = PayloadStyle("searchqa", create_returns_observation=False, score_scale=None,
                        reset_has_task_description=False, success=lambda total: total >= 1.0,
                        id_field="env_idx", task_field="id", bare_create=True, bare_reset=True)
WEBARENA = PayloadStyle("webarena", create_returns_observation=False, score_scale=None,
                        reset_has_task_description=False, success=lambda total: total >= 1.0,
                        id_field="env_idx", task_field="idx", gym_step=True, close_object=True)

STYLES: dict[str, PayloadStyle] = {
    style.name: style for style in (TEXTCRAFT, BABYAI, SCIWORLD, SEARCHQA, WEBARENA)
}


def style_for(env_name: str, style: str | None = None) -> PayloadStyle:
  """The payload style named `style`, or by default the one of environment `env_name`."""
  if style is None:
    return STYLES.get(env_name, TEXTCRAFT)
  if style not in STYLES:
    raise ValueError(f"unknown payload style {style!r}; expected one of {sorted(STYLES)}")
  return STYLES[style]


def extract_action(reply: str) -> str:
  """The action of a "Thought: ...\\n\\nAction: ..." reply, for servers that take bare actions.

  The action is the first non-empty line after the last "Action:"; a reply without that marker
  is sent whole (stripped). Our own server passes whole replies to adapters, which parse them.
  """
  _, marker, after = reply.rpartition("Action:")
  if not marker:
    return reply.strip()
  for line in after.splitlines():
    if line.strip():
      return line.strip()
  return ""
