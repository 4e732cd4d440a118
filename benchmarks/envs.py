"""Environment throughput: steps/s of each native env in-process, through EnvPool and over HTTP.

  python benchmarks/envs.py                                 # all four envs, < 3 min on 2 cores
  python benchmarks/envs.py --envs=textcraft,babyai --episodes=128 --steps=20
  python benchmarks/envs.py --quick --envs=textcraft        # a smoke run, a few seconds

Every mode plays the same episodes: episode e is test task task_ids[e % len(task_ids)], played
for at most --steps steps by a scripted policy that reads only the observations, so it plays
alike in every mode:
  textcraft  the oracle's plan (environments.textcraft.solve on the first observation): gold
             get/craft actions, episodes end in success.
  babyai     a pick among the observation's "Available actions" (random, seeded by the task
             id): valid actions, high-level ones run BabyAI's path search.
  sciworld   an explorer cycling "look around", "open door to D", "go to D", "inventory", with
             D the first door the last observation names: valid moves (the gold path costs
             tens of seconds to generate per task, and the text gives no action list).
  searchqa   search the question, then the title of the last top document; answer that title
             on the last step: real BM25 searches, episodes end through an answer.

Modes (one row each):
  in-process    one adapter, episodes one after another.
  pool/thread   EnvPool of `slots` adapters, thread backend.
  pool/process  the same with the process backend; only for GIL-bound envs (all work in Python).
  http          an AgentGymServer in a subprocess (launch/serve_env.py on a free 127.0.0.1
                port) and an EnvPool of `slots` "http" client adapters (thread backend).
`slots` is --slots (32), capped at 2 per core where every slot builds a costly adapter
(_COSTLY: a JVM per SciWorld adapter, a question set and index per SearchQA process). The pools
play in waves of `slots` episodes, as the rollout does: a reset batch, then step batches of the
live episodes until every one is done or at the step cap. By default a mode plays two waves of
the env's widest pool.

Each mode first plays a warm-up wave, one train episode on every adapter; "setup s" is its wall
time, so it holds building the adapters (a process spawn, a JVM start, the server's adapters
over HTTP) and their first-use costs (caches, a JVM's JIT). The measured episodes follow:
steps/s is their env steps over the time spent in step calls (policy time left out), "x
in-proc" its ratio to the in-process row, resets/s their resets over the time in reset calls.
The server's own start is printed as a note. Other work on the machine skews every figure: the
header gives the load average, the last line the CPU time the run used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import random
import re
import resource
import sys
import time
from typing import Sequence

from absl import app
from absl import flags

import environments
from environments.base import StepResult
from environments.http.served import serve_in_subprocess
from environments.pool import EnvPool

ENVS = ("textcraft", "babyai", "sciworld", "searchqa")

_ENVS = flags.DEFINE_list("envs", list(ENVS), f"Environments to measure, from {ENVS}.")
_EPISODES = flags.DEFINE_integer(
    "episodes", None, "Episodes per mode (default: two waves of the env's slots; --quick: 8).")
_STEPS = flags.DEFINE_integer("steps", 10, "Step cap of an episode (--quick: 5).")
_SLOTS = flags.DEFINE_integer(
    "slots", 32, "Concurrent episodes in the pools and over HTTP (capped where adapters are "
    "costly to build, see _COSTLY; --quick: at most 4).")
_QUICK = flags.DEFINE_bool("quick", False, "A smoke run: few slots, episodes and steps.")

_QUICK_EPISODES, _QUICK_STEPS, _QUICK_SLOTS = 8, 5, 4
# The (env, mode) pairs where every slot builds a costly adapter: each SciWorld adapter starts
# its own JVM (about 150 MB and 5 s of CPU), each SearchQA child process generates its own
# question set and BM25 index (about 6 s of CPU). They get at most _COSTLY_SLOTS_PER_CORE slots
# per core, which keeps the full run to minutes on 2 cores; more would add start-up work, not
# parallel steps.
_COSTLY = frozenset({("sciworld", "pool/thread"), ("sciworld", "http"),
                     ("searchqa", "pool/process")})
_COSTLY_SLOTS_PER_CORE = 2


def slots_for(env: str, mode: str, slots: int) -> int:
  """The slots `mode` runs `env` with when --slots asks for `slots`."""
  if (env, mode) in _COSTLY:
    return min(slots, _COSTLY_SLOTS_PER_CORE * len(os.sched_getaffinity(0)))
  return slots


# Envs whose steps run in Python under the GIL, where only processes run steps in parallel.
# SciWorld's steps run in its JVM, outside the GIL.
_GIL_BOUND = frozenset({"textcraft", "babyai", "searchqa"})


def pool_modes(env: str) -> tuple[str, ...]:
  """The modes, besides in-process, that `env` is measured in."""
  return ("pool/thread", "pool/process", "http") if env in _GIL_BOUND else ("pool/thread", "http")


_SERVER_START_TIMEOUT_S = 120.0
# Generous: a reset may build an adapter (a JVM over HTTP) on a machine busy with other work.
_RESET_TIMEOUT_S = 600.0

# Policies: one object per episode, `reply(observation)` once per step.


def _reply(action: str) -> str:
  return f"Thought: benchmark policy.\n\nAction: {action}"


class _TextCraftOracle:
  """The oracle's plan for the goal of the first observation, one action per step."""

  def __init__(self, task_id: int, first_observation: str, max_steps: int):
    del task_id, max_steps
    self._plan = iter(_textcraft_plan(first_observation))

  def reply(self, observation: str) -> str:
    del observation
    return _reply(next(self._plan, "inventory"))


@functools.lru_cache(maxsize=None)
def _textcraft_plan(first_observation: str) -> tuple[str, ...]:
  from environments.textcraft import solve  # pylint: disable=g-import-not-at-top
  return tuple(solve(first_observation))


_AVAILABLE = re.compile(r"^Available actions: (\[.*\])$", re.MULTILINE)


class _BabyAIRandomValid:
  """A random pick among the actions the last observation lists, seeded by the task id."""

  def __init__(self, task_id: int, first_observation: str, max_steps: int):
    del first_observation, max_steps
    self._rng = random.Random(task_id)

  def reply(self, observation: str) -> str:
    listed = _AVAILABLE.findall(observation)
    if not listed:
      raise RuntimeError(f"a BabyAI observation without available actions:\n{observation}")
    return _reply(self._rng.choice(json.loads(listed[-1])))


_DOOR = re.compile(r"A door to the ([\w ]+?) \(")


class _SciWorldExplorer:
  """Cycles look around / open door to D / go to D / inventory; D: the first door last seen."""

  def __init__(self, task_id: int, first_observation: str, max_steps: int):
    del task_id, max_steps
    self._door = "hallway"
    self._step = 0

  def reply(self, observation: str) -> str:
    if doors := _DOOR.findall(observation):
      self._door = doors[0]
    action = ("look around", f"open door to {self._door}", f"go to {self._door}",
              "inventory")[self._step % 4]
    self._step += 1
    return _reply(action)


_QUESTION = re.compile(r"^Question: (.*)$", re.MULTILINE)
_TOP_TITLE = re.compile(r"Doc 1\(Title: (.*?)\)")


class _SearchQAFollower:
  """Searches the question, then the last top document's title; answers it on the last step."""

  def __init__(self, task_id: int, first_observation: str, max_steps: int):
    del task_id
    self._query = _QUESTION.search(first_observation).group(1)
    self._steps_left = max_steps

  def reply(self, observation: str) -> str:
    if title := _TOP_TITLE.search(observation):
      self._query = title.group(1)
    self._steps_left -= 1
    tag = "answer" if self._steps_left == 0 else "search"
    return f"<think>benchmark policy</think>\n<{tag}> {self._query} </{tag}>"


POLICIES = {
    "textcraft": _TextCraftOracle,
    "babyai": _BabyAIRandomValid,
    "sciworld": _SciWorldExplorer,
    "searchqa": _SearchQAFollower,
}

# Measurements.


@dataclasses.dataclass
class Measurement:
  """One row of the table: what one mode did after its warm-up, and how long its calls took."""

  env: str
  mode: str
  slots: int
  setup_s: float = 0.0  # the warm-up: building the adapters, one episode on each
  episodes: int = 0
  steps: int = 0
  step_s: float = 0.0  # time in step calls
  reset_s: float = 0.0  # time in reset calls
  errors: list[str] = dataclasses.field(default_factory=list)  # warm-up included
  server_start_s: float | None = None  # http: until the server subprocess answered

  @property
  def steps_per_s(self) -> float:
    return self.steps / self.step_s if self.step_s else float("nan")

  @property
  def resets_per_s(self) -> float:
    return self.episodes / self.reset_s if self.reset_s else float("nan")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to run for one env."""

  env: str
  warmup_ids: tuple[int, ...]  # train tasks, one per adapter of the widest pool
  task_ids: tuple[int, ...]  # the measured episodes' test tasks
  max_steps: int
  slots: int  # as asked for; `slots_for` applies the caps

  def slots_for(self, mode: str) -> int:
    return slots_for(self.env, mode, self.slots)


class _OneAdapter:
  """One adapter behind EnvPool's batch calls, run in this thread (the in-process mode)."""

  num_slots = 1

  def __init__(self, env: str):
    self._env = environments.make(env)

  def reset(self, requests: Sequence[tuple[int, int]]) -> list[StepResult]:
    [(_, task_id)] = requests
    return [StepResult(self._env.reset(task_id), 0.0, False, {})]

  def step(self, requests: Sequence[tuple[int, str]]) -> list[StepResult]:
    [(_, reply)] = requests
    return [self._env.step(reply)]

  def close(self) -> None:
    self._env.close()


def play(plan: Plan, pool: EnvPool | _OneAdapter, measurement: Measurement) -> Measurement:
  """A warm-up wave, then the measured episodes in waves of `pool.num_slots`.

  The warm-up plays one train episode on every adapter, so that building adapters and their
  first-use costs (imports, caches, a JVM's JIT) stay out of the measured rates.
  """
  start = time.perf_counter()
  _play_wave(plan, pool, plan.warmup_ids[:pool.num_slots], Measurement(plan.env, "", 0),
             measurement.errors)
  measurement.setup_s = time.perf_counter() - start
  for first in range(0, len(plan.task_ids), pool.num_slots):
    _play_wave(plan, pool, plan.task_ids[first:first + pool.num_slots], measurement,
               measurement.errors)
  return measurement


def _play_wave(plan: Plan, pool: EnvPool | _OneAdapter, task_ids: Sequence[int],
               measurement: Measurement, errors: list[str]) -> None:
  """A reset batch, then step batches of the live episodes until all end or hit the cap."""
  policy_type = POLICIES[plan.env]
  start = time.perf_counter()
  results = pool.reset(list(enumerate(task_ids)))
  measurement.reset_s += time.perf_counter() - start
  measurement.episodes += len(task_ids)
  observations, policies = {}, {}
  for slot, (task_id, result) in enumerate(zip(task_ids, results)):
    if result.done:
      errors.append(result.info.get("error", "a reset ended the episode"))
      continue
    observations[slot] = result.observation
    policies[slot] = policy_type(task_id, result.observation, plan.max_steps)
  for _ in range(plan.max_steps):
    if not policies:
      break
    requests = [(slot, policy.reply(observations[slot])) for slot, policy in policies.items()]
    start = time.perf_counter()
    results = pool.step(requests)
    measurement.step_s += time.perf_counter() - start
    measurement.steps += len(results)
    for (slot, _), result in zip(requests, results):
      if "termination" in result.info:
        errors.append(result.info["error"])
      if result.done:
        del policies[slot]
      else:
        observations[slot] = result.observation


def play_in_process(plan: Plan) -> Measurement:
  measurement = Measurement(plan.env, "in-process", slots=1)
  start = time.perf_counter()
  adapter = _OneAdapter(plan.env)
  build_s = time.perf_counter() - start
  try:
    play(plan, adapter, measurement)
  finally:
    adapter.close()
  measurement.setup_s += build_s  # The pools build theirs in the warm-up's resets.
  return measurement


def play_env_pool(plan: Plan, backend: str) -> Measurement:
  mode = f"pool/{backend}"
  measurement = Measurement(plan.env, mode, slots=plan.slots_for(mode))
  with EnvPool(plan.env, measurement.slots, backend=backend,
               reset_timeout_s=_RESET_TIMEOUT_S) as pool:
    return play(plan, pool, measurement)


def play_http(plan: Plan) -> Measurement:
  """Plays through an env served by a subprocess."""
  measurement = Measurement(plan.env, "http", slots=plan.slots_for("http"))
  start = time.perf_counter()
  with serve_in_subprocess(plan.env, start_timeout_s=_SERVER_START_TIMEOUT_S,
                           max_envs=measurement.slots) as served:
    measurement.server_start_s = time.perf_counter() - start
    options = {"base_url": served.url, "env": plan.env, "timeout_s": _RESET_TIMEOUT_S}
    with EnvPool("http", measurement.slots, options=options,
                 reset_timeout_s=_RESET_TIMEOUT_S) as pool:
      return play(plan, pool, measurement)


# The run.


def make_plan(env: str, episodes: int | None, max_steps: int, slots: int, quick: bool) -> Plan:
  if quick:
    slots = min(slots, _QUICK_SLOTS)
  widest = max(slots_for(env, mode, slots) for mode in pool_modes(env))
  if episodes is None:
    episodes = _QUICK_EPISODES if quick else 2 * widest
  adapter = environments.make(env)
  try:
    train_ids, test_ids = tuple(adapter.task_ids("train")), tuple(adapter.task_ids("test"))
  finally:
    adapter.close()
  return Plan(env, warmup_ids=tuple(train_ids[i % len(train_ids)] for i in range(widest)),
              task_ids=tuple(test_ids[e % len(test_ids)] for e in range(episodes)),
              max_steps=max_steps, slots=slots)


def run_env(plan: Plan) -> tuple[list[Measurement], list[str]]:
  """Every mode of one env: its rows, and notes on what they did."""
  rows = [play_in_process(plan)] + [
      play_http(plan) if mode == "http" else play_env_pool(plan, mode.removeprefix("pool/"))
      for mode in pool_modes(plan.env)
  ]
  notes = []
  for row in rows:
    if row.server_start_s is not None:
      notes.append(f"{plan.env}: the HTTP server subprocess answered after "
                   f"{row.server_start_s:.1f} s.")
    if row.errors:
      notes.append(f"{plan.env} {row.mode}: {len(row.errors)} env faults, e.g. {row.errors[0]}")
    if row.steps != rows[0].steps:
      notes.append(f"{plan.env} {row.mode}: played {row.steps} steps, in-process "
                   f"{rows[0].steps} (the episodes did not replay alike).")
  return rows, notes


def table(rows: Sequence[Measurement]) -> str:
  lines = [
      "| env | mode | slots | episodes | steps | steps/s | x in-proc | setup s | resets/s |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|"
  ]
  in_process = {row.env: row.steps_per_s for row in rows if row.mode == "in-process"}
  for row in rows:
    ratio = row.steps_per_s / in_process[row.env] if row.env in in_process else float("nan")
    lines.append(f"| {row.env} | {row.mode} | {row.slots} | {row.episodes} | {row.steps} | "
                 f"{row.steps_per_s:,.0f} | {ratio:.2f} | {row.setup_s:.2f} | "
                 f"{row.resets_per_s:,.0f} |")
  return "\n".join(lines)


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  with contextlib.suppress(OSError):
    with open("/proc/cpuinfo") as cpuinfo:
      cpu = next(
          (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
  load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
  return (f"{len(os.sched_getaffinity(0))} cores ({cpu}), Python {platform.python_version()}, "
          f"load average at start {load}")


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = sorted(set(_ENVS.value) - set(ENVS))
  if unknown:
    raise app.UsageError(f"unknown envs {unknown}; choose from {ENVS}")
  if _EPISODES.value is not None and _EPISODES.value < 1:
    raise app.UsageError(f"--episodes must be >= 1, got {_EPISODES.value}")
  if _STEPS.value < 1 or _SLOTS.value < 1:
    raise app.UsageError(f"--steps and --slots must be >= 1, got {_STEPS.value}, {_SLOTS.value}")
  max_steps = min(_STEPS.value, _QUICK_STEPS) if _QUICK.value else _STEPS.value
  header = f"Machine: {machine()}\nCommand: python {' '.join(sys.argv)}"
  rows, notes = [], []
  start = time.perf_counter()
  for env in _ENVS.value:
    try:
      plan = make_plan(env, _EPISODES.value, max_steps, _SLOTS.value, _QUICK.value)
    except Exception as e:  # An env that cannot be built here (no Java, a missing package).
      notes.append(f"{env}: skipped, environments.make({env!r}) failed: {type(e).__name__}: {e}")
      print(notes[-1], file=sys.stderr, flush=True)
      continue
    env_rows, env_notes = run_env(plan)
    rows += env_rows
    notes += env_notes
    print(f"{env}: done after {time.perf_counter() - start:.0f} s wall, {_cpu_seconds():.0f} s CPU",
          file=sys.stderr, flush=True)
  print(f"{header}\n\n{table(rows)}\n")
  for env in dict.fromkeys(row.env for row in rows):
    print(f"- {env} policy: {POLICIES[env].__doc__}")
  for note in notes:
    print(f"- {note}")
  print(f"- total: {time.perf_counter() - start:.0f} s wall, {_cpu_seconds():.0f} s CPU (this "
        "process and its children: pool processes, servers, JVMs)")


def _cpu_seconds() -> float:
  return sum(usage.ru_utime + usage.ru_stime
             for usage in (resource.getrusage(resource.RUSAGE_SELF),
                           resource.getrusage(resource.RUSAGE_CHILDREN)))


if __name__ == "__main__":
  app.run(main)
