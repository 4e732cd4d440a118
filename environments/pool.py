"""A pool of environment adapters stepped concurrently on host CPUs.

The rollout keeps B episodes alive at once. `EnvPool` holds `num_slots` slots, each owning one
adapter, and runs a batch of resets or steps on many slots concurrently:

  with EnvPool("textcraft", num_slots=64) as pool:
    first = pool.reset([(slot, task_id), ...])          # list[StepResult], one per pair
    future = pool.step_async([(slot, reply), ...])      # overlap with device work, then
    results = future.result()                           # list[StepResult], in request order

Backends. Every slot has one worker thread that owns its adapter and runs that adapter's calls
in order, so a batch runs on all its slots at once.
  backend="thread": the adapter lives in the worker thread. Right for cheap envs and for envs
    that wait outside the GIL (remote HTTP adapters, a JVM).
  backend="process": the adapter lives in a child process (one per slot, started with "spawn"
    so that it is safe next to JAX's threads) and the worker thread forwards calls over a pipe.
    Right for GIL-bound envs, and the only backend that can end a hung adapter.

Faults end one episode, never the batch. An adapter call that raises or outlasts its timeout
yields StepResult(observation="", reward=0.0, done=True, info={"error": <reason>, "termination":
"env_error" | "env_timeout"}); the adapter is discarded and the slot's next reset builds a fresh
one. A hung *thread* cannot be killed in Python: the thread backend abandons it (it closes its
adapter and exits if the call ever returns, as a daemon thread it does not block exit). The
process backend kills the hung child's whole process group, so helper processes the adapter
started (a JVM) die with it.

A pool's calls run on coordinator threads: calls that share a slot run one after another, in
the order they were made, and calls on disjoint slots run at the same time. So `step_async` may
be called again before the last future resolved, and the batches of two groups of slots (a
pipelined rollout's) overlap each other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from absl import logging

from environments import base
from environments.base import ENV_ERROR, ENV_TIMEOUT, Env, EnvError, StepResult
from environments.latency import StepLatency, slowed

BACKENDS = ("thread", "process")
# How long close() waits for a worker to close its adapter before giving up on (thread) or
# killing (process) it.
_CLOSE_GRACE_S = 10.0

_Call = Callable[[Env], Any]
_UNASKED = object()
# Attributes an adapter may lack; a child process answers None for them.
_OPTIONAL_ATTRIBUTES = ("action_format",)


@dataclasses.dataclass(frozen=True)
class Environment:
  """The environment a task is played in, as the rollout reads it: the `name` its episodes
  record, the `pool` whose adapters play them (the instruction and tools come from it) and its
  own turn cap `max_turns` (None: the rollout's alone)."""

  name: str
  pool: EnvPool
  max_turns: int | None = None

  def cap(self, horizon: int) -> int:
    """The turn cap of an episode played under the rollout's `horizon`."""
    return horizon if self.max_turns is None else min(horizon, self.max_turns)


def episode_failure(termination: str, reason: str) -> StepResult:
  """The result that ends an episode whose environment failed (not the agent)."""
  return StepResult(observation="", reward=0.0, done=True,
                    info={"error": reason, "termination": termination})


class EnvPool:
  """`num_slots` adapters of one environment, reset and stepped in concurrent batches."""

  def __init__(self, env: str | Callable[[], Env], num_slots: int, *,
               options: Mapping[str, Any] | None = None, backend: str = "thread",
               step_timeout_s: float = 60.0, reset_timeout_s: float = 300.0,
               latency: StepLatency | None = None):
    """Creates the pool; adapters are built lazily, by each slot's first call.

    Args:
      env: a registered environment name, built with `environments.make(env, **options)`, or a
        zero-argument factory returning an adapter. The process backend builds adapters in
        child processes, so there a name must be registered in environments/base.py (not at
        run time) and a factory must be picklable (a module-level callable or a
        functools.partial of one).
      num_slots: how many adapters (and episodes) the pool holds.
      options: keyword arguments for `environments.make`; only with a name.
      backend: "thread" or "process" (see the module docstring).
      step_timeout_s: how long a step may take before its episode ends with "env_timeout".
      reset_timeout_s: the same for a reset, which includes building a fresh adapter.
      latency: a drawn time every step sleeps first (environments/latency.py), or None.
    """
    if backend not in BACKENDS:
      raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if num_slots < 1:
      raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if step_timeout_s <= 0 or reset_timeout_s <= 0:
      raise ValueError(f"timeouts must be > 0, got step_timeout_s={step_timeout_s}, "
                       f"reset_timeout_s={reset_timeout_s}")
    if isinstance(env, str):
      factory = functools.partial(base.make, env, **(options or {}))
      self.env_name = env
    elif callable(env):
      if options:
        raise ValueError("options are for environment names; bind them into the factory")
      factory = env
      target = env.func if isinstance(env, functools.partial) else env
      self.env_name = str(getattr(target, "name", None) or getattr(target, "__name__", target))
    else:
      raise TypeError(f"env must be a registered name or a factory, got {type(env).__name__}")
    if latency is not None:
      factory = functools.partial(slowed, factory, latency)
    if backend == "process":
      try:
        pickle.dumps(factory)
      except Exception as e:
        raise ValueError(
            "backend='process' builds adapters in child processes and needs a picklable "
            f"factory (a module-level callable or functools.partial of one): {e}") from e
      self._make_adapter = functools.partial(_ProcessAdapter, factory)
    else:
      self._make_adapter = factory
    self.num_slots = num_slots
    self.backend = backend
    self._step_timeout_s = step_timeout_s
    self._reset_timeout_s = reset_timeout_s
    self._workers: list[_Worker | None] = [None] * num_slots
    self._running = [False] * num_slots  # whether the slot's episode is in progress
    self._instruction: str | None = None
    self._tools: Any = _UNASKED  # The tools' schemas (or None) once asked.
    self._environment = Environment(self.env_name, self)
    self._closed = False
    # A batch waits for the earlier batches on its slots (FIFO: they were dequeued first, so
    # waiting never deadlocks); one thread per slot lets disjoint batches all run at once.
    self._coordinator = concurrent.futures.ThreadPoolExecutor(
        max_workers=num_slots, thread_name_prefix="envpool-coordinator")
    self._last_call: dict[int, concurrent.futures.Future] = {}
    self._submit_lock = threading.Lock()

  # Batches.

  def reset(self, requests: Sequence[tuple[int, int]]) -> list[StepResult]:
    """Starts the episodes `[(slot, task_id), ...]`; see `reset_async`."""
    return self.reset_async(requests).result()

  def step(self, requests: Sequence[tuple[int, str]]) -> list[StepResult]:
    """Applies the replies `[(slot, reply), ...]`; see `step_async`."""
    return self.step_async(requests).result()

  def reset_async(
      self, requests: Sequence[tuple[int, int]]) -> concurrent.futures.Future[list[StepResult]]:
    """Starts one episode per (slot, task_id) pair, concurrently.

    A slot with an episode in progress abandons it. The results hold the first observations as
    StepResult(observation, 0.0, False, {}); a failed reset gives a done result with
    info["termination"] set, as a failed step does.
    """
    return self._submit([slot for slot, _ in requests], self._reset_batch, list(requests))

  def step_async(
      self, requests: Sequence[tuple[int, str]]) -> concurrent.futures.Future[list[StepResult]]:
    """Applies one model reply per (slot, reply) pair, concurrently.

    Every slot must have an episode in progress. The future's result lists one StepResult per
    pair, in request order; bad requests (unknown or repeated slots, a slot without an episode)
    raise ValueError from `future.result()`.
    """
    return self._submit([slot for slot, _ in requests], self._step_batch, list(requests))

  # What an adapter knows without an episode (asked of slot 0's adapter).

  @property
  def instruction(self) -> str:
    if self._instruction is None:
      self._instruction = self._ask(lambda env: env.instruction, "instruction")
    return self._instruction

  @property
  def tools(self) -> list[dict[str, Any]] | None:
    """The JSON schemas of the adapters' tools in the tool_call action format, else None."""
    if self._tools is _UNASKED:
      self._tools = self._ask(base.tools_of, "tools")
    return self._tools

  def environment(self, task_id: int) -> Environment:
    """The environment task `task_id` is played in: this pool's, for every task (a mixture's
    pool, environments/mixture.py, has one per component)."""
    del task_id
    return self._environment

  def task_ids(self, split: str) -> Sequence[int]:
    base.check_split(split)
    return self._ask(lambda env: env.task_ids(split), f"task_ids({split!r})")

  def task_info(self, task_id: int) -> dict[str, Any]:
    return self._ask(lambda env: env.task_info(task_id), f"task_info({task_id})")

  # Life cycle.

  def close(self) -> None:
    """Closes every adapter and stops every thread and process of the pool. Idempotent."""
    if self._closed:
      return
    self._closed = True
    self._coordinator.shutdown(wait=True)
    workers = [worker for worker in self._workers if worker is not None]
    self._workers = [None] * self.num_slots
    for worker in workers:
      worker.stop()
    deadline = time.monotonic() + _CLOSE_GRACE_S
    for worker in workers:
      if not worker.join(max(0.0, deadline - time.monotonic())):
        worker.kill()
        worker.join(1.0)

  def __enter__(self) -> EnvPool:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  # Internals. Everything below runs on coordinator threads, one batch per slot at a time.

  def _submit(self, slots: Sequence[Any], batch: Callable[..., Any], *args:
              Any) -> concurrent.futures.Future:
    """Runs batch(*args) once the earlier calls on any of `slots` have finished."""
    if self._closed:
      raise RuntimeError("EnvPool is closed")
    # Slots outside the pool are not waited on: the batch's own checks reject them.
    slots = {slot for slot in slots if isinstance(slot, int) and 0 <= slot < self.num_slots}
    with self._submit_lock:
      earlier = [self._last_call[slot] for slot in slots if slot in self._last_call]
      future = self._coordinator.submit(_after, earlier, batch, *args)
      for slot in slots:
        self._last_call[slot] = future
    return future

  def _ask(self, call: _Call, what: str) -> Any:
    """Runs `call` on slot 0's adapter; a failure raises EnvError (there is no episode)."""

    def ask() -> Any:
      [(value, failure)] = self._run([(0, call)], self._reset_timeout_s, what)
      if failure is not None:
        raise EnvError(failure.info["error"])
      return value

    return self._submit([0], ask).result()

  def _reset_batch(self, requests: list[tuple[int, int]]) -> list[StepResult]:
    self._check_slots(requests)
    for slot, task_id in requests:
      if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id < 0:
        raise ValueError(f"task ids are non-negative ints; slot {slot} got {task_id!r}")
    calls = [(slot, lambda env, task_id=task_id: env.reset(task_id)) for slot, task_id in requests]
    results = []
    for (slot,
         task_id), (observation, failure) in zip(requests,
                                                 self._run(calls, self._reset_timeout_s, "reset")):
      if failure is None and not isinstance(observation, str):
        failure = self._fail(slot, ENV_ERROR,
                             f"reset({task_id}) returned {type(observation).__name__}, not str")
      self._running[slot] = failure is None
      results.append(failure or StepResult(observation, 0.0, False, {}))
    return results

  def _step_batch(self, requests: list[tuple[int, str]]) -> list[StepResult]:
    self._check_slots(requests)
    for slot, reply in requests:
      if not self._running[slot]:
        raise ValueError(f"slot {slot} has no episode in progress; reset it first")
      if not isinstance(reply, str):
        raise ValueError(f"replies are str; slot {slot} got {type(reply).__name__}")
    calls = [(slot, lambda env, reply=reply: env.step(reply)) for slot, reply in requests]
    results = []
    for (slot, _), (result, failure) in zip(requests, self._run(calls, self._step_timeout_s,
                                                                "step")):
      if failure is None and not isinstance(result, StepResult):
        failure = self._fail(slot, ENV_ERROR,
                             f"step returned {type(result).__name__}, not StepResult")
      result = failure or result
      self._running[slot] = not result.done
      results.append(result)
    return results

  def _check_slots(self, requests: Sequence[tuple[int, Any]]) -> None:
    slots = [slot for slot, _ in requests]
    for slot in slots:
      if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
        raise ValueError(f"slot {slot!r} is not in [0, {self.num_slots})")
    if len(set(slots)) != len(slots):
      raise ValueError(f"a batch names each slot at most once, got slots {slots}")

  def _run(self, calls: list[tuple[int, _Call]], timeout_s: float,
           what: str) -> list[tuple[Any, StepResult | None]]:
    """Runs one call per slot concurrently; returns (value, None) or (None, failure) each."""
    futures = []
    for slot, call in calls:
      if self._workers[slot] is None:
        self._workers[slot] = _Worker(self._make_adapter, f"envpool-slot-{slot}")
      futures.append(self._workers[slot].submit(call))
    deadline = time.monotonic() + timeout_s
    outcomes = []
    for (slot, _), future in zip(calls, futures):
      try:
        outcomes.append((future.result(timeout=max(0.0, deadline - time.monotonic())), None))
      except Exception as e:
        if not future.done():  # The wait timed out, not the adapter raising TimeoutError.
          failure = self._fail(slot, ENV_TIMEOUT,
                               f"{self.env_name} {what} in slot {slot} took over {timeout_s} s")
        else:
          failure = self._fail(
              slot, ENV_ERROR, f"{self.env_name} {what} in slot {slot} raised "
              f"{type(e).__name__}: {e}")
        outcomes.append((None, failure))
    return outcomes

  def _fail(self, slot: int, termination: str, reason: str) -> StepResult:
    """Discards the slot's adapter (its next reset builds a fresh one) and ends its episode."""
    logging.warning("EnvPool: %s; discarding the adapter", reason)
    worker, self._workers[slot] = self._workers[slot], None
    if worker is not None:
      if termination == ENV_TIMEOUT:
        worker.kill()
      else:
        worker.stop()
    self._running[slot] = False
    return episode_failure(termination, reason)


def _after(earlier: Sequence[concurrent.futures.Future], batch: Callable[..., Any], *args:
           Any) -> Any:
  concurrent.futures.wait(earlier)
  return batch(*args)


class _Worker:
  """A daemon thread that owns one adapter and runs calls on it one at a time.

  The adapter is built by the first call, so building counts against that call's timeout.
  After `stop()` the thread finishes its current call, runs no other, closes the adapter and
  exits.
  """

  def __init__(self, make_adapter: Callable[[], Env], name: str):
    self._make_adapter = make_adapter
    self._adapter: Env | None = None
    self._calls: queue.SimpleQueue = queue.SimpleQueue()
    self._stopping = threading.Event()
    self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
    self._thread.start()

  def submit(self, call: _Call) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._calls.put((future, call))
    return future

  def stop(self) -> None:
    self._stopping.set()
    self._calls.put(None)

  def kill(self) -> None:
    """Stops, and kills the adapter's process if it has one (threads cannot be killed)."""
    self.stop()
    # Read after stop(): an adapter still being built is seen here or, once built, by _serve
    # as stopped; either way it never starts a call.
    adapter = self._adapter
    if isinstance(adapter, _ProcessAdapter):
      adapter.kill()

  def join(self, timeout_s: float) -> bool:
    """Waits for the thread to exit; returns whether it did."""
    self._thread.join(timeout_s)
    return not self._thread.is_alive()

  def _serve(self) -> None:
    while (item := self._calls.get()) is not None:
      future, call = item
      if not future.set_running_or_notify_cancel():
        continue
      try:
        if self._adapter is None:
          self._adapter = self._make_adapter()
        if self._stopping.is_set():
          raise EnvError("the adapter was discarded")
        future.set_result(call(self._adapter))
      except BaseException as e:  # Reported to the pool, which ends only this episode.
        future.set_exception(e)
    if self._adapter is not None:
      try:
        self._adapter.close()
      except Exception as e:
        logging.warning("EnvPool: closing an adapter raised %s: %s", type(e).__name__, e)


class _ProcessAdapter:
  """An adapter that lives in a child process; this proxy forwards calls over a pipe.

  The child leads its own process group, so `kill()` also ends processes the adapter started.
  """

  def __init__(self, factory: Callable[[], Env]):
    context = multiprocessing.get_context("spawn")
    self._conn, child_conn = context.Pipe()
    self._process = context.Process(target=_serve_adapter, args=(child_conn, factory),
                                    name="envpool-adapter", daemon=True)
    self._process.start()
    # Without our copy of the child's end, recv() sees EOF as soon as the child dies.
    child_conn.close()
    self._closed = False

  @property
  def pid(self) -> int:
    return self._process.pid

  @property
  def instruction(self) -> str:
    return self._request("instruction")

  @property
  def action_format(self) -> base.ActionFormat | None:
    return self._request("action_format")

  def task_ids(self, split: str) -> Sequence[int]:
    return self._request("task_ids", split)

  def task_info(self, task_id: int) -> dict[str, Any]:
    return self._request("task_info", task_id)

  def reset(self, task_id: int) -> str:
    return self._request("reset", task_id)

  def step(self, action_text: str) -> StepResult:
    return self._request("step", action_text)

  def kill(self) -> None:
    # ValueError: close() in the worker thread released the process meanwhile.
    with contextlib.suppress(ValueError):
      if self._closed or self._process.exitcode is not None:
        return
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(self._process.pid, signal.SIGKILL)
      with contextlib.suppress(ProcessLookupError):
        self._process.kill()  # In case the child had not yet made its own group.

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    if self._process.exitcode is None:
      with contextlib.suppress(OSError):
        self._conn.send(("close", ()))
      self._process.join(_CLOSE_GRACE_S)
      if self._process.exitcode is None:
        self.kill()
        self._process.join()
    self._conn.close()
    self._process.close()

  def _request(self, name: str, *args: Any) -> Any:
    try:
      self._conn.send((name, args))
      status, value = self._conn.recv()
    except (EOFError, OSError):
      self._process.join(1.0)
      raise EnvError(f"the adapter process {self._process.pid} died "
                     f"(exit code {self._process.exitcode})") from None
    if status == "error":
      raise EnvError(value)
    return value


def _serve_adapter(conn: multiprocessing.connection.Connection, factory: Callable[[], Env]) -> None:
  """A child process's main loop: answers (method, args) requests until "close" or EOF."""
  os.setpgrp()
  adapter = None
  try:
    while True:
      try:
        name, args = conn.recv()
      except EOFError:  # The pool's process died.
        return
      if name == "close":
        return
      try:
        if adapter is None:
          adapter = factory()
        value = (getattr(adapter, name, None) if name in _OPTIONAL_ATTRIBUTES else getattr(
            adapter, name))
        reply = ("ok", value(*args) if callable(value) else value)
      except Exception as e:  # Exceptions may not pickle; their text always does.
        reply = ("error", f"{type(e).__name__}: {e}")
      conn.send(reply)
  finally:
    if adapter is not None:
      adapter.close()
    conn.close()
