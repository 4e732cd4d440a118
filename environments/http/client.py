"""An adapter (the `Env` protocol) for an environment behind an AgentGym-protocol HTTP server.

  env = environments.make("http", base_url="http://127.0.0.1:36001", env="textcraft")

It talks to our server (environments/http/server.py) and to the original AgentGym servers; the
payload style follows the environment name (protocol.py). Rewards come back normalised as our
adapters report them: from score-style servers the per-step reward is the increment of the score
(floored at 0) over `score_scale`.

Faults. Connection failures, and 5xx answers to requests that are safe to repeat, are retried
with exponential backoff (`backoff_s`, doubling, capped at `max_backoff_s`, `retries` times). A
/step that reached the env and failed there (500) is not retried: applying the action twice
would corrupt the episode. If the server lost the env (it restarted, or closed the env as idle),
/reset creates a new one and carries on; a /step cannot recover the lost episode and raises
EnvError, which ends that episode in `EnvPool`. Every failure raises EnvError naming the server,
the route and the reason.

Several servers. With `base_urls=[...]` each client starts on the next server in turn, so the
slots of a pool spread evenly. A server that cannot be reached (after the retries) ends the
episodes on it; the next reset of each of its clients moves to the following live server.
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
import urllib.parse
from typing import Any, Mapping, Sequence

from absl import logging

from environments import base
from environments.base import EnvError, StepResult
from environments.http import protocol
from environments.http.endpoint import NOT_DELIVERED, Endpoint, answer_field, split_task_ids

# How the original servers say that an id is unknown (they answer 200 {"error": ...}); ours
# also says code "unknown_env".
_LOST_ENV_PHRASES = ("is not valid", "has been deleted")

# Which server of `base_urls` the next client starts on.
_SPREAD = itertools.count()
_SPREAD_LOCK = threading.Lock()


class _EnvLost(Exception):
  """The server does not know our env id any more."""


class _Unreachable(EnvError):
  """The server did not answer, or answered 5xx, through every retry."""


class AgentGymClient:
  """One remote env (one id on the server), used one episode at a time."""

  def __init__(self, base_url: str | None = None, env: str = "", *,
               base_urls: Sequence[str] | None = None, style: str | None = None,
               extract_action: bool = False, instruction: str | None = None,
               task_ids: Mapping[str, Sequence[int]] | None = None, timeout_s: float = 120.0,
               retries: int = 5, backoff_s: float = 0.1, max_backoff_s: float = 5.0):
    """Configures the client; the remote env is created by the first reset.

    Args:
      base_url: the server, e.g. "http://127.0.0.1:36001" (a path prefix is kept).
      base_urls: several servers instead (see the module docstring); give one of the two.
      env: the environment's name; it picks the payload style and is this adapter's `name`.
      style: a payload style name (protocol.STYLES) overriding the one of `env`.
      extract_action: send only the action of each reply (`protocol.extract_action`), as the
        original AgentGym servers expect; our server takes whole replies.
      instruction, task_ids: what the env would tell, for servers without /instruction and
        /task_ids (the original AgentGym servers); task_ids maps each split to its ids.
      timeout_s: the socket timeout of one request; a timed-out request is not retried.
      retries, backoff_s, max_backoff_s: the retry schedule for connection errors and 5xx.
    """
    if (base_url is None) == (base_urls is None) or base_urls == []:
      raise ValueError("give base_url or a non-empty base_urls, not both")
    if not env:
      raise ValueError("env (the environment's name) is required")
    self._endpoints = [
        Endpoint(url, timeout_s, retries, backoff_s, max_backoff_s)
        for url in ([base_url] if base_urls is None else base_urls)
    ]
    with _SPREAD_LOCK:
      self._server = next(_SPREAD) % len(self._endpoints)
    self._endpoint = self._endpoints[self._server]
    self._task_ids = None if task_ids is None else split_task_ids(task_ids)
    self.name = env
    self.base_url = self._endpoint.base_url
    self.style = protocol.style_for(env, style)
    self._prefix = self._endpoint.url.path
    self._extract_action = extract_action
    self._instruction = instruction
    self._connection: http.client.HTTPConnection | None = None
    self._env_id: int | None = None
    self._running = False
    self._total = 0.0  # the episode's running total: summed rewards, or the last score

  # The Env protocol.

  @property
  def instruction(self) -> str:
    if self._instruction is None:
      payload = self._get_own_route("/instruction", {}, "instruction=")
      self._instruction = answer_field(payload, "instruction", str, "GET /instruction")
    return self._instruction

  def task_ids(self, split: str) -> Sequence[int]:
    base.check_split(split)
    if self._task_ids is not None:
      return self._task_ids[split]
    payload = self._get_own_route("/task_ids", {"split": split}, "task_ids=")
    return tuple(answer_field(payload, "task_ids", list, "GET /task_ids"))

  def task_info(self, task_id: int) -> dict[str, Any]:
    payload = self._get_own_route("/task_info", {"data_idx": task_id}, "")
    if not isinstance(payload, dict):
      raise EnvError(f"{self.base_url} GET /task_info answered {payload!r}, not an object")
    return payload

  def reset(self, task_id: int) -> str:
    self._running = False
    for server in range(len(self._endpoints)):
      try:
        return self._reset_here(task_id)
      except _Unreachable as e:
        if server + 1 == len(self._endpoints):
          raise
        logging.warning("AgentGymClient: %s; moving to the next server", e)
        self._move_to_next_server()
    raise AssertionError("unreachable")

  def _move_to_next_server(self) -> None:
    self._disconnect()
    self._env_id = None
    self._server = (self._server + 1) % len(self._endpoints)
    self._endpoint = self._endpoints[self._server]
    self.base_url, self._prefix = self._endpoint.base_url, self._endpoint.url.path

  def _reset_here(self, task_id: int) -> str:
    for attempt in range(2):
      if self._env_id is None:
        self._create()
      try:
        payload = self._env_call(
            "/reset", {self.style.id_field: self._env_id, self.style.task_field: task_id})
        break
      except _EnvLost:
        if attempt:
          raise EnvError(f"{self.base_url} lost env {self._env_id} right after creating it")
        logging.warning("AgentGymClient: %s lost env %s; creating a new one", self.base_url,
                        self._env_id)
        self._env_id = None
    if self.style.bare_reset and isinstance(payload, str):
      payload = {"observation": payload}
    observation = answer_field(payload, "observation", str, "POST /reset")
    if self.style.reset_has_task_description and payload.get("task_description"):
      observation = f"{payload['task_description']}\n{observation}"
    self._total = float(payload.get("score", 0.0)) if self.style.score_scale else 0.0
    self._running = True
    return observation

  def step(self, action_text: str) -> StepResult:
    if not self._running:
      raise EnvError("step() without an episode in progress; reset() first")
    action = protocol.extract_action(action_text) if self._extract_action else action_text
    try:
      payload = self._env_call("/step", {self.style.id_field: self._env_id, "action": action},
                               retry_statuses=NOT_DELIVERED)
    except _EnvLost:
      self._env_id, self._running = None, False
      raise EnvError(f"{self.base_url} lost env mid-episode (did the server restart or close "
                     "it as idle?); the next reset creates a new env") from None
    except EnvError:
      self._running = False
      raise
    observation = answer_field(payload, "observation", str, "POST /step")
    done = answer_field(payload, "terminated" if self.style.gym_step else "done", bool,
                        "POST /step")
    info = dict(payload.get("info") or {})
    scale = self.style.score_scale
    if scale is None:
      reward = float(answer_field(payload, "reward", (int, float), "POST /step"))
      self._total += reward
    else:
      score = float(answer_field(payload, "score", (int, float), "POST /step"))
      reward = (max(score, 0.0) - max(self._total, 0.0)) / scale  # See protocol.py.
      self._total = score
      info["score"] = score
    success = payload["success"] if "success" in payload else done and self.style.success(
        self._total)
    info["success"] = bool(success)
    self._running = not done
    return StepResult(observation, reward, done, info)

  def close(self) -> None:
    """Closes the remote env (best effort) and the connection. Idempotent."""
    if self._env_id is not None:
      env_id, self._env_id, self._running = self._env_id, None, False
      try:
        self._request("POST", "/close", {self.style.id_field: env_id}, retries=0)
      except EnvError as e:  # Some original servers have no /close; the env then idles out.
        logging.info("AgentGymClient: closing env %s at %s: %s", env_id, self.base_url, e)
    if self._connection is not None:
      self._connection.close()
      self._connection = None

  # Requests.

  def _create(self) -> None:
    status, payload = self._request("POST", "/create", {})
    self._raise_for_error("POST /create", status, payload)
    if self.style.bare_create and isinstance(payload, int):
      payload = {self.style.id_field: payload}
    self._env_id = answer_field(payload, self.style.id_field, int, "POST /create")

  def _env_call(self, route: str, body: dict[str, Any],
                retry_statuses: frozenset[int] | None = None) -> Any:
    """POSTs to an env route; raises _EnvLost if the server no longer knows our id."""
    status, payload = self._request("POST", route, body, retry_statuses=retry_statuses)
    error = payload.get("error") if isinstance(payload, dict) else None
    lost = isinstance(error, str) and (payload.get("code") == "unknown_env"
                                       or any(phrase in error for phrase in _LOST_ENV_PHRASES))
    if status == 200 and lost:
      raise _EnvLost(error)
    self._raise_for_error(f"POST {route}", status, payload)
    return payload

  def _get_own_route(self, route: str, query: Mapping[str, Any], option: str) -> Any:
    """GETs one of the routes only our server has; explains what to do if it is missing."""
    status, payload = self._request("GET", route + "?" + urllib.parse.urlencode(query))
    if status in (404, 405, 501) and not (isinstance(payload, dict) and "code" in payload):
      hint = f"; pass {option}... to the client" if option else ""
      raise EnvError(f"{self.base_url} does not serve GET {route} (an original AgentGym "
                     f"server?){hint}")
    self._raise_for_error(f"GET {route}", status, payload)
    return payload

  def _raise_for_error(self, what: str, status: int, payload: Any) -> None:
    error = payload.get("error") if isinstance(payload, dict) else None
    if status >= 400 or error is not None:
      detail = error or (payload.get("detail") if isinstance(payload, dict) else None)
      raise EnvError(f"{self.base_url} {what} failed ({status}): {detail or payload!r}")

  def _request(self, method: str, route: str, body: dict[str, Any] | None = None, *,
               retries: int | None = None,
               retry_statuses: frozenset[int] | None = None) -> tuple[int, Any]:
    """Sends one request with retries; returns (status, decoded JSON) of the last answer.

    Connection failures are retried, and so are the answers in `retry_statuses` (by default
    every 5xx). A timeout is not: the server may still be working on the request.
    """
    retries = self._endpoint.retries if retries is None else retries
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    for attempt in self._endpoint.attempts(retries):
      try:
        connection = self._connect()
      except OSError as e:  # Nothing was sent: always safe to retry.
        failure = f"cannot connect: {type(e).__name__}: {e}"
        continue
      try:
        connection.request(method, self._prefix + route, body=data, headers=headers)
        response = connection.getresponse()
        raw = response.read()
      except TimeoutError:
        self._disconnect()
        raise EnvError(f"{self.base_url} {method} {route} timed out after "
                       f"{self._endpoint.timeout_s} s") from None
      except (OSError, http.client.HTTPException) as e:  # Often a keep-alive the server ended.
        self._disconnect()
        failure = f"{type(e).__name__}: {e}"
        continue
      if response.getheader("Connection", "").lower() == "close":
        self._disconnect()
      try:
        payload = json.loads(raw) if raw else None
      except ValueError:
        payload = raw.decode(errors="replace")
      is_retried = (response.status >= 500
                    if retry_statuses is None else response.status in retry_statuses)
      if is_retried and attempt < retries:
        failure = f"HTTP {response.status}: {payload!r}"
        continue
      return response.status, payload
    raise _Unreachable(f"{self.base_url} {method} {route} failed after {retries + 1} attempts; "
                       f"last error: {failure}")

  def _connect(self) -> http.client.HTTPConnection:
    """The open keep-alive connection, or a newly connected one."""
    if self._connection is None:
      url = self._endpoint.url
      kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
      connection = kind(url.hostname, url.port, timeout=self._endpoint.timeout_s)
      try:
        connection.connect()
        # http.client sends headers and body separately; see the server's TCP_NODELAY.
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      except OSError:
        connection.close()
        raise
      self._connection = connection
    return self._connection

  def _disconnect(self) -> None:
    if self._connection is not None:
      self._connection.close()
      self._connection = None
