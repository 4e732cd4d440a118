"""An adapter (the `Env` protocol) for a remote AgentGym WebArena server.

  env = environments.make("webarena_remote", base_url="http://10.0.0.5:36005",
                          config_dir="~/webarena/config_files")

AgentGym's WebArena server (agentenv-webarena) keys its envs by "env_idx", not "id":

  POST /create {}                             -> {"env_idx": int}  (logs in to every site: slow)
  POST /reset  {env_idx, seed: 0, idx: task}  -> {"observation": the accessibility tree}
  GET  /observation?env_idx=                  -> the whole prompt (a JSON string): the tree, URL,
                                                 objective and previous action, as our
                                                 WebArenaEnv renders it
  POST /step   {env_idx, action: the reply}   -> {observation, reward, terminated, truncated,
                                                 info}
  POST /close  {env_idx}                      -> "closed" (plain text)

As AgentGym's own client does, the first observation is GET /observation after /reset, and
whole replies go to /step (the server finds the action between triple backticks). Until the
episode ends the server's reward is WebArena's "the action ran" flag, not an outcome, so we
report 0 for those steps and the server's evaluator score at the end (terminated or truncated);
info["success"] is whether that score is 1. If the server fails while stepping it answers with
the error text as the observation, which we pass on. The server has no step limit: the
rollout's turn cap ends episodes, unevaluated (reward 0), as in AgentGym-RL.

Task ids are WebArena task ids (the server opens config_files/<id>.json). Which ids exist, and
their metadata, come from a local copy of the configs (`config_dir`, split as WebArenaEnv
splits), or from an explicit `task_ids` mapping.

Faults. Refused connections and 502/503/504 answers (nothing reached the env) are retried with
exponential backoff; /reset and /observation also retry other 5xx answers and dropped
connections. /step does not (applying an action twice would corrupt the episode), nor does
/create (a second env would be left on the server). A timeout is never retried. Every failure
raises EnvError naming the server, the route and the reason.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Mapping, Sequence

from environments import base
from environments.base import EnvError, StepResult
from environments.http.endpoint import NOT_DELIVERED, Endpoint, answer_field, split_task_ids
from environments.webarena import tasks


class AgentGymWebArenaClient:
  """One env (one env_idx) on an AgentGym WebArena server, one episode at a time."""

  name = "webarena"

  def __init__(self, base_url: str, *, config_dir: str | None = None,
               task_ids: Mapping[str, Sequence[int]] | None = None, num_test: int = 50,
               test_task_ids: Sequence[int] | None = None, instruction: str | None = None,
               timeout_s: float = 600.0, retries: int = 5, backoff_s: float = 0.5,
               max_backoff_s: float = 10.0):
    """Configures the client; the remote env is created by the first reset.

    Args:
      base_url: the server, e.g. "http://127.0.0.1:36005" (a path prefix is kept).
      config_dir: local copies of the server's task configs, for task ids and metadata.
      task_ids: instead of config_dir, the ids of each split, {"train": [...], "test": [...]}.
      num_test, test_task_ids: the split of config_dir's tasks (tasks.split).
      instruction: the text shown before the first observation; default WebArenaEnv's.
      timeout_s: the socket timeout of one request (the server's /create logs in to every
        site, and its steps sleep, so it is long).
      retries, backoff_s, max_backoff_s: the retry schedule (module docstring).
    """
    self._endpoint = Endpoint(base_url, timeout_s, retries, backoff_s, max_backoff_s)
    if (config_dir is None) == (task_ids is None):
      raise ValueError("pass exactly one of config_dir (local copies of the server's task "
                       "configs) and task_ids ({'train': [...], 'test': [...]})")
    self.base_url = self._endpoint.base_url
    self._tasks: dict[int, tasks.Task] = {}
    if config_dir is not None:
      self._tasks = tasks.load_tasks(config_dir)
      self._splits = tasks.split(self._tasks, num_test, test_task_ids)
    else:
      self._splits = split_task_ids(task_ids)
    self._instruction = instruction
    self._env_idx: int | None = None
    self._running = False

  @property
  def instruction(self) -> str:
    if self._instruction is None:
      from environments.webarena import env  # Its text describes the server's prompts too.
      self._instruction = env.instruction_text(viewport_only=True, max_steps=None)
    return self._instruction

  def task_ids(self, split: str) -> Sequence[int]:
    return self._splits[base.check_split(split)]

  def task_info(self, task_id: int) -> dict[str, Any]:
    if task_id in self._tasks:
      return self._tasks[task_id].info()
    if not any(task_id in ids for ids in self._splits.values()):
      raise ValueError(f"unknown WebArena task id {task_id!r}")
    return {"category": "webarena"}

  def reset(self, task_id: int) -> str:
    self._running = False
    if self._env_idx is None:
      payload = self._post("/create", {}, idempotent=False)
      self._env_idx = answer_field(payload, "env_idx", int, "POST /create")
    self._post("/reset", {"env_idx": self._env_idx, "seed": 0, "idx": task_id})
    observation = self._request("GET", f"/observation?env_idx={self._env_idx}")
    if not isinstance(observation, str):
      raise EnvError(f"{self.base_url} GET /observation answered {observation!r}, not a string")
    self._running = True
    return observation

  def step(self, action_text: str) -> StepResult:
    if not self._running:
      raise EnvError("step() without an episode in progress; reset() first")
    try:
      payload = self._post("/step", {"env_idx": self._env_idx, "action": action_text},
                           idempotent=False)
    except EnvError:
      self._running = False
      raise
    observation = answer_field(payload, "observation", str, "POST /step")
    terminated = answer_field(payload, "terminated", bool, "POST /step")
    done = terminated or bool(payload.get("truncated", False))
    score = float(answer_field(payload, "reward", (int, float), "POST /step"))
    reward = score if done else 0.0  # See the module docstring.
    info = payload.get("info") if isinstance(payload.get("info"), dict) else {}
    info = {**info, "success": done and reward >= 1.0}
    self._running = not done
    return StepResult(observation, reward, done, info)

  def close(self) -> None:
    """Closes the remote env (best effort). Idempotent."""
    if self._env_idx is not None:
      env_idx, self._env_idx, self._running = self._env_idx, None, False
      try:
        self._request("POST", "/close", {"env_idx": env_idx}, retries=0)
      except EnvError:  # The server may be gone already; nothing is left to release here.
        pass

  def _post(self, route: str, body: dict[str, Any], idempotent: bool = True) -> dict[str, Any]:
    payload = self._request("POST", route, body, idempotent=idempotent)
    if not isinstance(payload, dict):
      raise EnvError(f"{self.base_url} POST {route} answered {payload!r}, not a JSON object")
    return payload

  def _request(self, method: str, route: str, body: dict[str, Any] | None = None, *,
               retries: int | None = None, idempotent: bool = True) -> Any:
    """Sends one request with retries; returns the decoded JSON (or text) answer.

    Every request is retried when it cannot have reached the env (a refused connection, a
    502/503/504 from a proxy); an idempotent one also after other 5xx answers and dropped
    connections.
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(self.base_url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    failure = ""
    for attempt in self._endpoint.attempts(retries):
      try:
        with urllib.request.urlopen(request, timeout=self._endpoint.timeout_s) as response:
          return _decode(response.read())
      except urllib.error.HTTPError as e:
        failure = f"HTTP {e.code}: {_decode(e.read())!r}"
        if not (e.code in NOT_DELIVERED or (idempotent and e.code >= 500)):
          break
      except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, TimeoutError):  # The server may still be working on it.
          raise EnvError(f"{self.base_url} {method} {route} timed out after "
                         f"{self._endpoint.timeout_s} s") from None
        failure = f"{type(reason).__name__}: {reason}"
        if not (idempotent or isinstance(reason, ConnectionRefusedError)):
          break
    raise EnvError(f"{self.base_url} {method} {route} failed after {attempt + 1} attempt(s); "
                   f"last error: {failure}")


def _decode(raw: bytes) -> Any:
  try:
    return json.loads(raw)
  except ValueError:
    return raw.decode(errors="replace")
