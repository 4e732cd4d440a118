"""An AgentGym-protocol HTTP server for any registered adapter.

  with AgentGymServer("textcraft", port=36001) as server:   # serves in background threads
    ...                                                      # clients talk to server.url

Routes and payloads are AgentGym's (protocol.py, and PROTOCOL.md route by route); the payload
style follows the environment name. Each hosted env has an id and its own adapter; requests run
concurrently, one thread per connection, and a per-env lock keeps one env's calls in order, so
states never mix.

Every error carries a JSON body {"error": "...", "code": "..."}. As in the original servers, a
well-formed request naming an unknown (or closed) env id, an unknown task, or an env whose episode
has finished is answered 200 with that body (the original clients assert 200), and /close of an
unknown id answers false. The rest are HTTP errors: 400 malformed JSON, wrong types or missing
fields (the original's FastAPI answers 422); 404 unknown routes; 405 a known route with the wrong
method; 409 an env busy past `busy_timeout_s`; 411/413 a body without a length or over
`max_body_bytes`; 503 `max_envs` envs already hosted; 500 a failing adapter. A failing adapter
affects only its env: it is discarded and the env's next /reset builds a fresh one. Envs untouched
for `idle_timeout_s` are closed. Nothing a client sends can stop the server or get a 5xx: JSON
nested past the parser's depth, non-ASCII digits and oversized numbers are 400s, an unparseable
request line is answered under a status line, and a client that goes away mid-request is one
log line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import re
import secrets
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterator, Mapping

from absl import logging

from environments import base
from environments.base import ENV_ERROR, Env, StepResult
from environments.http import httpd, protocol
from environments.http.httpd import HTTPError


@dataclasses.dataclass
class _HostedEnv:
  """One env a client created: its adapter and where its episode stands."""

  adapter: Env | None
  last_used: float
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  closed: bool = False
  running: bool = False  # an episode is in progress
  started: bool = False  # an episode was started and its adapter has not failed since
  observation: str = ""
  reward: float = 0.0  # the last step's reward, in the style's units
  episode_return: float = 0.0  # the sum of the episode's (normalised) rewards

  def close_adapter(self) -> None:
    """Closes the adapter, if any, and forgets it; the caller holds `lock`."""
    adapter, self.adapter = self.adapter, None
    if adapter is not None:
      _close_quietly(adapter)


class AgentGymServer(httpd.App):
  """Hosts adapters of one environment behind the AgentGym HTTP protocol."""

  def __init__(self, env: str, *, options: Mapping[str, Any] | None = None,
               style: str | None = None, host: str = "127.0.0.1", port: int = 0,
               max_envs: int = 256, idle_timeout_s: float = 1800.0, max_body_bytes: int = 1 << 20,
               busy_timeout_s: float = 30.0):
    """Binds the socket; `start()` or `serve_forever()` serves.

    Args:
      env: a registered environment name; adapters are `environments.make(env, **options)`.
      options: keyword arguments for `environments.make`.
      style: a payload style name (protocol.STYLES); by default the one of `env`.
      host, port: where to listen; port 0 picks a free port (see `.port`).
      max_envs: how many envs may be hosted at once; /create answers 503 beyond.
      idle_timeout_s: envs untouched this long are closed; 0 never closes them.
      max_body_bytes: larger request bodies are refused with 413.
      busy_timeout_s: how long a request waits for its env's previous request before 409.
    """
    if env not in base.registered():
      raise ValueError(f"unknown environment {env!r}; registered: {base.registered()}")
    if max_envs < 1:
      raise ValueError(f"max_envs must be >= 1, got {max_envs}")
    if idle_timeout_s < 0:
      raise ValueError(f"idle_timeout_s must be >= 0 (0 disables), got {idle_timeout_s}")
    self.env_name = env
    self.style = protocol.style_for(env, style)
    self._options = dict(options or {})
    self._max_envs = max_envs
    self._idle_timeout_s = idle_timeout_s or math.inf
    self._busy_timeout_s = busy_timeout_s
    self._envs: dict[int, _HostedEnv] = {}
    self._creating = 0  # /create requests building an adapter now
    self._lock = threading.Lock()  # guards _envs and _creating
    # Ids start at a random offset so that a client of a restarted server, still holding an
    # old id, is told the id is unknown instead of driving another client's new env.
    self._ids = itertools.count(secrets.randbelow(1 << 30))
    # One spare adapter answers /instruction, /task_ids and /task_info and validates data_idx.
    self._meta_adapter: Env | None = None
    self._meta_lock = threading.Lock()
    self._split_task_ids: dict[str, tuple[int, ...]] | None = None
    self._all_task_ids: frozenset[int] = frozenset()
    self._routes: dict[tuple[str, str], Callable[[dict[str, str], bytes], Any]] = {
        ("GET", "/"): self._health,
        ("POST", "/create"): self._create,
        ("POST", "/reset"): self._reset,
        ("POST", "/step"): self._step,
        ("GET", "/observation"): self._observation,
        ("POST", "/close"): self._close,
        ("GET", "/instruction"): self._instruction,
        ("GET", "/task_ids"): self._task_ids_route,
        ("GET", "/task_info"): self._task_info,
    }
    if self.style is protocol.TEXTCRAFT:  # The original TextCraft server's inspection routes.
      self._routes.update({
          ("GET", "/commands"): self._commands,
          ("GET", "/goal"): self._goal,
          ("GET", "/detail"): self._detail,
      })
    super().__init__((host, port), _Handler, name="AgentGymServer", max_body_bytes=max_body_bytes)
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._shut_down = False

  def num_envs(self) -> int:
    with self._lock:
      return len(self._envs)

  # Life cycle.

  def start(self) -> AgentGymServer:
    """Serves in background threads until `shutdown()`."""
    self._threads = [
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1},
                         name=f"agentgym-{self.env_name}-http", daemon=True),
        threading.Thread(target=self._close_idle_forever, name=f"agentgym-{self.env_name}-janitor",
                         daemon=True)
    ]
    for thread in self._threads:
      thread.start()
    return self

  def serve_forever(self) -> None:
    """Serves in this thread until another thread calls `shutdown()`."""
    self.start()
    self._stop.wait()

  def shutdown(self) -> None:
    """Stops serving, drops open connections and closes every adapter. Idempotent."""
    if self._shut_down:
      return
    self._shut_down = True
    self._stop.set()
    if self._threads:
      self._http.shutdown()
    self._http.server_close()
    self._http.drop_connections(grace_s=0.0)
    for thread in self._threads:
      thread.join()
    with self._lock:
      hosted, self._envs = list(self._envs.values()), {}
    for env in hosted:
      self._discard(env, wait_s=1.0)
    if self._meta_lock.acquire(timeout=1.0):  # Not if a hung call holds it.
      if self._meta_adapter is not None:
        _close_quietly(self._meta_adapter)
        self._meta_adapter = None
      self._meta_lock.release()

  # Dispatch (called by request threads).

  def handle(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
    """Answers one request: (HTTP status, JSON-serialisable payload)."""
    url = urllib.parse.urlsplit(target)
    route = self._routes.get((method, url.path))
    try:
      if route is None:
        allowed = [m for m, path in self._routes if path == url.path]
        if allowed:
          raise HTTPError(405, f"{url.path} takes {' or '.join(allowed)}, not {method}",
                          "method_not_allowed")
        raise HTTPError(
            404, f"unknown route {method} {url.path}; routes: " +
            ", ".join(f"{m} {p}" for m, p in self._routes), "unknown_route")
      query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
      return 200, route(query, body)
    except HTTPError as e:
      return e.status, _error_payload(e.message, e.code)
    except Exception as e:  # A bug of ours: answer it, log it, keep serving.
      logging.exception("AgentGymServer: %s %s failed", method, url.path)
      return 500, _error_payload(f"internal error: {type(e).__name__}: {e}", "internal")

  # Routes.

  def _health(self, query: dict[str, str], body: bytes) -> dict[str, Any]:
    return {
        "env": self.env_name, "protocol": "agentgym", "style": self.style.name,
        "envs": self.num_envs(), "max_envs": self._max_envs,
        "idle_timeout_s": None if math.isinf(self._idle_timeout_s) else self._idle_timeout_s
    }

  def _create(self, query: dict[str, str], body: bytes) -> Any:
    # Fields are accepted and not used: the original TextCraft client sends minecraft_dir,
    # commands and goal, and the original server starts the env id's task all the same.
    _json_object(body, allow_empty=True)
    self._close_idle()
    with self._lock:
      if len(self._envs) + self._creating >= self._max_envs:
        raise HTTPError(
            503, f"the server already hosts its maximum of {self._max_envs} envs; "
            "close some (POST /close) or retry later", "max_envs")
      self._creating += 1
    try:
      adapter = self._make_adapter("create")
      hosted = _HostedEnv(adapter, last_used=time.monotonic())
      env_id = next(self._ids)
      payload: dict[str, Any] = {self.style.id_field: env_id}
      if self.style.create_returns_observation:
        # Like the original TextCraft server, /create also starts an episode: task number
        # (env id mod the number of tasks), so that envs start different goals.
        task_ids = sorted(self._all_task_ids_now())
        payload.update(self._start_episode(hosted, env_id, task_ids[env_id % len(task_ids)]))
      with self._lock:
        self._envs[env_id] = hosted
    finally:
      with self._lock:
        self._creating -= 1
    return env_id if self.style.bare_create else payload

  def _reset(self, query: dict[str, str], body: bytes) -> Any:
    request = _json_object(body)
    env_id = _int_field(request, self.style.id_field)
    task_id = _int_field(request, self.style.task_field)
    self._check_task(task_id)
    with self._use(env_id) as hosted:
      if hosted.adapter is None:  # Its last adapter failed.
        hosted.adapter = self._make_adapter(f"reset env {env_id}")
      payload = self._start_episode(hosted, env_id, task_id)
    if self.style.bare_reset:
      return payload["observation"]
    if self.style.gym_step:
      info = self._ask_meta(f"task_info({task_id})", lambda env: env.task_info(task_id))
      return {**payload, "sites": info.get("sites", ""), "object": info.get("intent", "")}
    return payload

  def _step(self, query: dict[str, str], body: bytes) -> dict[str, Any]:
    request = _json_object(body)
    env_id = _int_field(request, self.style.id_field)
    action = _field(request, "action", str, "a string")
    with self._use(env_id) as hosted:
      if not (hosted.running or (self.style.plays_after_done and hosted.started)):
        raise _env_error(
            f"The task with environment {env_id} has finished (or failed, or was never "
            "reset); POST /reset starts an episode", "no_episode")
      result = self._call_adapter(hosted, env_id, "step", lambda env: env.step(action))
      if not isinstance(result, StepResult):
        self._fail(hosted, env_id, "step",
                   TypeError(f"step returned {type(result).__name__}, not StepResult"))
      hosted.running = not result.done
      hosted.observation = result.observation
      hosted.episode_return += result.reward
      payload = {"observation": result.observation, "done": result.done}
      payload.update(self._reward_fields(result.reward, hosted.episode_return, result.info))
      hosted.reward = payload["reward"]
      if self.style.gym_step:
        payload.update(terminated=result.done, truncated=False)
      payload["success"] = bool(result.info.get("success", False))
      payload["info"] = result.info
      return payload

  def _observation(self, query: dict[str, str], body: bytes) -> Any:
    env_id = _int_query(query, self.style.id_field)
    with self._use(env_id) as hosted:
      if not self.style.observation_object:
        return hosted.observation
      return {
          "observation": hosted.observation, "reward": hosted.reward,
          "score": self.style.score_scale * hosted.episode_return,
          "done": hosted.started and not hosted.running, "deleted": False
      }

  def _close(self, query: dict[str, str], body: bytes) -> Any:
    env_id = _int_field(_json_object(body), self.style.id_field)
    with self._lock:
      hosted = self._envs.pop(env_id, None)
    if hosted is not None:
      self._discard(hosted, wait_s=self._busy_timeout_s)
    if self.style.close_object:
      return {"closed": "closed" if hosted else f"Close Env {env_id} Error: unknown env id"}
    return hosted is not None

  def _commands(self, query: dict[str, str], body: bytes) -> Any:
    return self._episode_attribute(_int_query(query, "id"), "commands")

  def _goal(self, query: dict[str, str], body: bytes) -> Any:
    return self._episode_attribute(_int_query(query, "id"), "goal")

  def _detail(self, query: dict[str, str], body: bytes) -> dict[str, Any]:
    with self._use(_int_query(query, "id")) as hosted:
      return {
          "observation": hosted.observation, "reward": hosted.reward,
          "done": hosted.started and not hosted.running, "deleted": False
      }

  def _episode_attribute(self, env_id: int, name: str) -> Any:
    """An attribute of env `env_id`'s adapter (TextCraft's commands and goal)."""
    with self._use(env_id) as hosted:
      value = getattr(hosted.adapter, name, None) if hosted.started else None
      if value is None:
        raise _env_error(f"env {env_id} has no {name} (no episode started)", "no_episode")
      return value

  def _instruction(self, query: dict[str, str], body: bytes) -> dict[str, Any]:
    return {"instruction": self._ask_meta("instruction", lambda env: env.instruction)}

  def _task_ids_route(self, query: dict[str, str], body: bytes) -> dict[str, Any]:
    split = query.get("split")
    if split not in base.SPLITS:
      raise HTTPError(400, f"query parameter 'split' must be one of {base.SPLITS}, "
                      f"got {split!r}")
    return {"split": split, "task_ids": list(self._task_ids()[split])}

  def _task_info(self, query: dict[str, str], body: bytes) -> dict[str, Any]:
    task_id = _int_query(query, "data_idx")
    self._check_task(task_id)
    return self._ask_meta(f"task_info({task_id})", lambda env: env.task_info(task_id))

  # Episodes.

  def _start_episode(self, hosted: _HostedEnv, env_id: int, task_id: int) -> dict[str, Any]:
    observation = self._call_adapter(hosted, env_id, f"reset({task_id})",
                                     lambda env: env.reset(task_id))
    if not isinstance(observation, str):
      self._fail(hosted, env_id, "reset",
                 TypeError(f"reset returned {type(observation).__name__}, not str"))
    hosted.running = hosted.started = True
    hosted.observation = observation
    hosted.reward = hosted.episode_return = 0.0
    payload: dict[str,
                  Any] = {self.style.id_field: env_id, "observation": observation, "done": False}
    payload.update(self._reward_fields(0.0, 0.0, {}))
    if self.style.reset_has_task_description:
      # Our adapters return the task inside the first observation.
      payload["task_description"] = ""
    return payload

  def _reward_fields(self, reward: float, episode_return: float,
                     info: Mapping[str, Any]) -> dict[str, float]:
    """"reward" (and "score") in the style's units; see protocol.py."""
    scale = self.style.score_scale
    if scale is None:
      return {"reward": reward}
    return {"reward": scale * reward, "score": float(info.get("score", scale * episode_return))}

  def _call_adapter(self, hosted: _HostedEnv, env_id: int, what: str, call: Callable[[Env],
                                                                                     Any]) -> Any:
    try:
      return call(hosted.adapter)
    except Exception as e:
      self._fail(hosted, env_id, what, e)

  def _fail(self, hosted: _HostedEnv, env_id: int, what: str, error: Exception) -> None:
    """Discards a failing adapter (the env's next /reset builds a fresh one) and answers 500."""
    message = (f"the {self.env_name} adapter of env {env_id} failed in {what}: "
               f"{type(error).__name__}: {error}")
    logging.warning("AgentGymServer: %s", message)
    hosted.running = hosted.started = False
    hosted.close_adapter()
    raise HTTPError(500, message + "; POST /reset starts over with a fresh adapter",
                    ENV_ERROR) from error

  def _make_adapter(self, what: str) -> Env:
    try:
      return base.make(self.env_name, **self._options)
    except Exception as e:
      logging.warning("AgentGymServer: building a %s adapter failed", self.env_name, exc_info=True)
      raise HTTPError(
          500, f"could not build a {self.env_name} adapter ({what}): "
          f"{type(e).__name__}: {e}", ENV_ERROR) from e

  @contextlib.contextmanager
  def _use(self, env_id: int) -> Iterator[_HostedEnv]:
    """Holds env `env_id` for one request: 404 if unknown, 409 if busy too long."""
    with self._lock:
      hosted = self._envs.get(env_id)
    if hosted is None:
      raise _unknown_env(env_id)
    if not hosted.lock.acquire(timeout=self._busy_timeout_s):
      raise HTTPError(
          409, f"env {env_id} is still busy with an earlier request after "
          f"{self._busy_timeout_s} s", "busy")
    try:
      if hosted.closed:  # Closed while this request waited for it.
        raise _unknown_env(env_id)
      yield hosted
    finally:
      hosted.last_used = time.monotonic()
      hosted.lock.release()

  def _discard(self, hosted: _HostedEnv, wait_s: float) -> None:
    """Closes a hosted env that left the table, after its request in flight (up to wait_s)."""
    acquired = hosted.lock.acquire(timeout=wait_s)
    try:
      hosted.closed = True
      hosted.close_adapter()
    finally:
      if acquired:
        hosted.lock.release()

  def _close_idle(self) -> None:
    """Closes envs untouched for idle_timeout_s (skipping any that a request holds)."""
    now = time.monotonic()
    idle = []
    with self._lock:
      for env_id, hosted in list(self._envs.items()):
        if now - hosted.last_used > self._idle_timeout_s and hosted.lock.acquire(blocking=False):
          hosted.closed = True
          del self._envs[env_id]
          idle.append((env_id, hosted))
    for env_id, hosted in idle:
      logging.info("AgentGymServer: closing env %d, idle for over %s s", env_id,
                   self._idle_timeout_s)
      hosted.close_adapter()
      hosted.lock.release()

  def _close_idle_forever(self) -> None:
    period = min(self._idle_timeout_s / 2, 30.0)
    while not self._stop.wait(period):
      self._close_idle()

  # What the adapter knows without an episode.

  def _ask_meta(self, what: str, call: Callable[[Env], Any]) -> Any:
    with self._meta_lock:
      if self._meta_adapter is None:
        self._meta_adapter = self._make_adapter(what)
      try:
        return call(self._meta_adapter)
      except Exception as e:
        adapter, self._meta_adapter = self._meta_adapter, None
        _close_quietly(adapter)
        raise HTTPError(
            500, f"the {self.env_name} adapter failed in {what}: "
            f"{type(e).__name__}: {e}", ENV_ERROR) from e

  def _task_ids(self) -> dict[str, tuple[int, ...]]:
    """The task ids of each split, asked once of the spare adapter."""
    if self._split_task_ids is None:
      split_task_ids = {
          split:
              tuple(
                  self._ask_meta(f"task_ids({split!r})",
                                 lambda env, split=split: env.task_ids(split)))
          for split in base.SPLITS
      }
      self._all_task_ids = frozenset(itertools.chain.from_iterable(split_task_ids.values()))
      self._split_task_ids = split_task_ids
    return self._split_task_ids

  def _all_task_ids_now(self) -> frozenset[int]:
    self._task_ids()
    return self._all_task_ids

  def _check_task(self, task_id: int) -> None:
    if task_id not in self._all_task_ids_now():
      raise _env_error(
          f"data_idx {task_id} is not a task id of {self.env_name} "
          f"({len(self._all_task_ids)} task ids; GET /task_ids?split= lists them)", "unknown_task")


# Ids and task numbers are below 10^18 (ids count from below 2^30): a longer number in a query
# or body is refused before int() (which refuses over 4,300 digits) sees it.
_MAX_DIGITS = _MAX_QUERY_DIGITS = 18
_MAX_JSON_DEPTH = 64
_JSON_STRUCTURE = re.compile(r'[\[\]{}"\\]')


class _Handler(httpd.Handler):
  """AgentGym's answers: the app's (status, payload); errors as {"error": ..., "code": ...}."""

  def respond(self, method: str, body: bytes) -> httpd.Answer:
    return self.server.app.handle(method, self.path, body)

  def error_payload(self, status: int, message: str, code: str) -> dict[str, str]:
    return _error_payload(message, code)


def _json_depth(text: str) -> int:
  """The deepest nesting of arrays and objects in `text` (brackets inside strings skipped)."""
  depth = deepest = 0
  in_string = escaped = False
  for match in _JSON_STRUCTURE.finditer(text):
    char = match.group()
    if in_string:
      if escaped:
        escaped = False
      elif char == "\\":
        escaped = True
      elif char == '"':
        in_string = False
    elif char == '"':
      in_string = True
    elif char in "[{":
      depth += 1
      deepest = max(deepest, depth)
    elif char in "]}":
      depth -= 1
  return deepest


def _bounded_int(text: str) -> int:
  if len(text.lstrip("-")) > _MAX_DIGITS:
    raise ValueError(f"a number of more than {_MAX_DIGITS} digits")
  return int(text)


def _json_object(body: bytes, allow_empty: bool = False) -> dict[str, Any]:
  """The request's JSON object; nesting past _MAX_JSON_DEPTH and integers of more than
  _MAX_DIGITS digits are malformed (no field of the protocol needs either)."""
  if not body.strip():
    if allow_empty:
      return {}
    raise HTTPError(400, "missing JSON body")
  try:
    text = body.decode()
    if _json_depth(text) > _MAX_JSON_DEPTH:
      raise ValueError(f"nested too deeply (over {_MAX_JSON_DEPTH} levels)")
    value = json.loads(text, parse_int=_bounded_int)
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise HTTPError(400, f"malformed JSON body: {e}"[:300]) from None
  if not isinstance(value, dict):
    raise HTTPError(400, f"the JSON body must be an object, got {type(value).__name__}")
  return value


def _field(request: Mapping[str, Any], name: str, kind: type, kind_text: str) -> Any:
  """request[name], checked to be a `kind` (`kind_text` in the message; a bool is no int)."""
  if name not in request:
    raise HTTPError(400, f"missing field {name!r}")
  value = request[name]
  if not isinstance(value, kind) or isinstance(value, bool):
    raise HTTPError(400, f"field {name!r} must be {kind_text}, got {json.dumps(value)}")
  return value


def _int_field(request: Mapping[str, Any], name: str) -> int:
  value = _field(request, name, int, "an integer")
  if value < 0:
    raise HTTPError(400, f"field {name!r} must be >= 0, got {value}")
  return value


def _int_query(query: Mapping[str, str], name: str) -> int:
  if name not in query:
    raise HTTPError(400, f"missing query parameter {name!r}")
  text = query[name]
  # ASCII digits only ("²".isdigit() holds, int("²") fails), and few enough for int() (which
  # refuses over 4,300 digits); no id or task is that large.
  if not (text.isascii() and text.isdigit() and len(text) <= _MAX_QUERY_DIGITS):
    raise HTTPError(
        400, f"query parameter {name!r} must be a non-negative integer of at most "
        f"{_MAX_QUERY_DIGITS} digits, got {text[:40]!r}")
  return int(text)


def _error_payload(message: str, code: str) -> dict[str, str]:
  return {"error": message, "code": code}


def _env_error(message: str, code: str) -> HTTPError:
  """An env-level refusal, answered 200 {"error", "code"} as the original servers do."""
  return HTTPError(200, message, code)


def _unknown_env(env_id: int) -> HTTPError:
  # "is not valid" is the original servers' phrase, which clients look for.
  return _env_error(
      f"The id {env_id} is not valid: unknown env id (never created, closed, or closed "
      "after being idle); POST /create makes a new one", "unknown_env")


def _close_quietly(adapter: Env) -> None:
  try:
    adapter.close()
  except Exception as e:
    logging.warning("AgentGymServer: closing an adapter raised %s: %s", type(e).__name__, e)
