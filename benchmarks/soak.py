r"""Soak test: many episodes through EnvPool, watching memory, processes, fds and threads.

  python benchmarks/soak.py --envs=textcraft,babyai,sciworld --minutes=10
  python benchmarks/soak.py --envs=textcraft --episodes=2000 --every=200
  python benchmarks/soak.py --quick                  # ~1 min: textcraft and babyai, few waves

Each env plays waves of --slots episodes through one EnvPool (as the rollout does: a reset
batch, then step batches of the live episodes until all end or --max_steps), until --minutes
or --episodes. Replies come from a scripted policy that reads only the observations:
  textcraft  the oracle's plan (environments.textcraft.solve): gold actions, episodes succeed;
  babyai     a random pick among the observation's "Available actions";
  sciworld   a random pick among look around / inventory / open door to D / go to D, with D a
             door the last observation names;
and, with probability --junk, a bad reply instead (empty, 20k characters, control characters,
no "Action:"), so the error paths run too.

Every --every episodes (by default every tenth of --minutes) a row gives, for this process plus all its descendants: resident
memory (RSS, MB), child processes, open file descriptors and threads. The verdict fits a
least-squares line to each column over the rows after warm-up and calls a column growing when
the fitted line rises by more than its tolerance over those rows: memory by more than
max(--rss_tolerance_mb, 5 %), counts by more than 0.5. Warm-up is the first row (the first wave
builds the adapters and fills caches) and the rows within the first --warmup of the run's
episodes: a SciWorld JVM's JIT compiler keeps adding code for its first ~200 episodes (~13 MB),
which with 4 JVMs is the first ~800 episodes. A last row after the pool closed shows what the
pool left behind.
"""

from __future__ import annotations

import dataclasses
import random
import re
import sys
import time
from typing import Sequence

import numpy as np
import psutil
from absl import app, flags

import environments
from environments.pool import EnvPool

ENVS = ("textcraft", "babyai", "sciworld")

_ENVS = flags.DEFINE_list("envs", ["textcraft", "babyai"], f"Environments, from {ENVS}.")
_MINUTES = flags.DEFINE_float("minutes", 5.0, "Wall-time budget per environment.")
_EPISODES = flags.DEFINE_integer("episodes", 0, "Episode budget per environment; 0: none.")
_EVERY = flags.DEFINE_integer("every", 0, "Episodes between rows; 0: a row every tenth of "
                              "--minutes.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Concurrent episodes (SciWorld: at most 4 JVMs).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", 10, "Step cap of an episode.")
_BACKEND = flags.DEFINE_enum("backend", "thread", ["thread", "process"], "EnvPool backend.")
_JUNK = flags.DEFINE_float("junk", 0.1, "Probability of a bad reply instead of the policy's.")
_RSS_TOLERANCE_MB = flags.DEFINE_float("rss_tolerance_mb", 20.0,
                                       "Memory growth over the run still called flat.")
_WARMUP = flags.DEFINE_float(
    "warmup", 0.25, "Fraction of the run's episodes left out of the "
    "verdict's fit (the first row always is).")
_QUICK = flags.DEFINE_bool("quick", False, "A smoke run: 20 s per env, 8 slots.")

_MAX_SLOTS = {"sciworld": 4}  # Each SciWorld adapter runs its own JVM (~150 MB).
_JUNK_REPLIES = ("", "Action: " + "y" * 20_000, "Thought: \x00\x1b[2J\x7f\n\nAction: \x08",
                 "no marker here", "Action:\nAction:\nAction: inventory")

# Policies: one per episode, `reply(observation)` once per step.


def _reply(action: str) -> str:
  return f"Thought: soak policy.\n\nAction: {action}"


class _TextCraftOracle:

  def __init__(self, first_observation: str, rng: random.Random):
    from environments.textcraft import solve  # pylint: disable=g-import-not-at-top
    del rng
    self._plan = iter(solve(first_observation))

  def reply(self, observation: str) -> str:
    del observation
    return _reply(next(self._plan, "inventory"))


_AVAILABLE = re.compile(r"^Available actions: \[(.*)\]$", re.MULTILINE)


class _BabyAIRandom:

  def __init__(self, first_observation: str, rng: random.Random):
    del first_observation
    self._rng = rng

  def reply(self, observation: str) -> str:
    listed = _AVAILABLE.findall(observation)
    actions = re.findall(r'"([^"]+)"', listed[-1]) if listed else ["turn left"]
    return _reply(self._rng.choice(actions))


_DOOR = re.compile(r"A door to the ([\w ]+?) \(")


class _SciWorldRandom:

  def __init__(self, first_observation: str, rng: random.Random):
    del first_observation
    self._rng = rng
    self._door = "hallway"

  def reply(self, observation: str) -> str:
    if doors := _DOOR.findall(observation):
      self._door = self._rng.choice(doors)
    return _reply(
        self._rng.choice(
            ["look around", "inventory", f"open door to {self._door}", f"go to {self._door}"]))


POLICIES = {"textcraft": _TextCraftOracle, "babyai": _BabyAIRandom, "sciworld": _SciWorldRandom}

# Resource samples.


@dataclasses.dataclass
class Sample:
  episodes: int
  seconds: float
  rss_mb: float  # This process plus its descendants.
  children: int
  fds: int
  threads: int


def sample(episodes: int, start: float) -> Sample:
  me = psutil.Process()
  processes = [me] + me.children(recursive=True)
  rss = fds = threads = 0
  for process in processes:
    try:
      rss += process.memory_info().rss
      fds += process.num_fds()
      threads += process.num_threads()
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # Exited while we looked.
      pass
  return Sample(episodes, time.monotonic() - start, rss / 2**20, len(processes) - 1, fds, threads)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
  """The least-squares slope of ys over xs (0 for fewer than two distinct xs)."""
  xs, ys = np.asarray(xs, float), np.asarray(ys, float)
  if len(xs) < 2 or np.ptp(xs) == 0:
    return 0.0
  return float(np.polyfit(xs, ys, 1)[0])


def verdict(samples: Sequence[Sample], rss_tolerance_mb: float, warmup: float) -> list[str]:
  """One line per column: its fitted growth over the rows after warm-up, and a call."""
  steady = [s for s in samples[1:] if s.episodes > warmup * samples[-1].episodes]
  if len(steady) < 2:
    return ["too few rows for a verdict: run longer or lower --every"]
  episodes = [s.episodes for s in steady]
  span = episodes[-1] - episodes[0]
  lines = []
  for column, unit in (("rss_mb", "MB"), ("children", ""), ("fds", ""), ("threads", "")):
    values = [getattr(s, column) for s in steady]
    rate = slope(episodes, values)
    growth = rate * span
    tolerance = max(rss_tolerance_mb, 0.05 * values[0]) if column == "rss_mb" else 0.5
    call = "GROWING" if growth > tolerance else "flat"
    lines.append(f"{column:9s} {call:8s} fitted {growth:+9.2f}{unit} over {span} episodes "
                 f"({1000 * rate:+.3f}{unit}/1000 episodes; tolerance {tolerance:.1f}{unit})")
  return lines


# Playing.


def play_wave(pool: EnvPool, env: str, task_ids: Sequence[int], max_steps: int, junk: float,
              rng: random.Random) -> tuple[int, int]:
  """One wave; returns (env steps, episodes ended by an env fault)."""
  results = pool.reset(list(enumerate(task_ids)))
  faults = sum(r.done for r in results)
  observations = {slot: r.observation for slot, r in enumerate(results) if not r.done}
  policies = {slot: POLICIES[env](observations[slot], rng) for slot in observations}
  steps = 0
  for _ in range(max_steps):
    if not policies:
      break
    requests = [
        (slot,
         rng.choice(_JUNK_REPLIES) if rng.random() < junk else policy.reply(observations[slot]))
        for slot, policy in policies.items()
    ]
    results = pool.step(requests)
    steps += len(results)
    for (slot, _), result in zip(requests, results):
      if result.done:
        faults += "termination" in result.info
        del policies[slot]
      else:
        observations[slot] = result.observation
  return steps, faults


def soak(env: str, *, minutes: float, episodes: int, every: int, slots: int, max_steps: int,
         backend: str, junk: float, rss_tolerance_mb: float, warmup: float) -> None:
  slots = min(slots, _MAX_SLOTS.get(env, slots))
  adapter = environments.make(env)
  try:
    task_ids = list(adapter.task_ids("train"))
  finally:
    adapter.close()
  rng = random.Random(0)
  rng.shuffle(task_ids)
  print(
      f"\n== {env}: {slots} slots, {backend} backend, --max_steps={max_steps}, "
      f"--junk={junk}; a row every "
      f"{f'{every} episodes' if every else f'{6 * minutes:.0f} s'}", flush=True)
  header = (f"{'episodes':>9} {'seconds':>8} {'rss MB':>8} {'children':>8} {'fds':>6} "
            f"{'threads':>7} {'steps':>7} {'faults':>6}")
  print(header, flush=True)
  start = time.monotonic()
  before = sample(0, start)
  samples: list[Sample] = []
  played = steps = faults = 0
  with EnvPool(env, slots, backend=backend, reset_timeout_s=600.0) as pool:
    while (time.monotonic() - start < 60 * minutes and (not episodes or played < episodes)):
      wave = [task_ids[(played + i) % len(task_ids)] for i in range(slots)]
      wave_steps, wave_faults = play_wave(pool, env, wave, max_steps, junk, rng)
      played += len(wave)
      steps += wave_steps
      faults += wave_faults
      if every:
        due = not samples or played // every > samples[-1].episodes // every
      else:
        due = not samples or time.monotonic() - start >= samples[-1].seconds + 6 * minutes
      if due:
        samples.append(sample(played, start))
        _print_row(samples[-1], steps, faults)
  after = sample(played, start)
  print(f"{'closed':>9} {after.seconds:8.1f} {after.rss_mb:8.1f} {after.children:8d} "
        f"{after.fds:6d} {after.threads:7d}   (before the pool: {before.rss_mb:.1f} MB, "
        f"{before.children} children, {before.fds} fds, {before.threads} threads)")
  print(f"{played} episodes, {steps} steps, {played / max(after.seconds, 1e-9):.1f} "
        "episodes/s; verdict:")
  for line in verdict(samples, rss_tolerance_mb, warmup):
    print("  " + line)
  leaks = [
      f"{name} {getattr(after, name)} > {getattr(before, name)}" for name in ("children", "threads")
      if getattr(after, name) > getattr(before, name)
  ]
  print(
      "  after close: " +
      ("LEFT BEHIND " + ", ".join(leaks) if leaks else "no child processes or threads left behind"),
      flush=True)


def _print_row(s: Sample, steps: int, faults: int) -> None:
  print(
      f"{s.episodes:9d} {s.seconds:8.1f} {s.rss_mb:8.1f} {s.children:8d} {s.fds:6d} "
      f"{s.threads:7d} {steps:7d} {faults:6d}", flush=True)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = sorted(set(_ENVS.value) - set(ENVS))
  if unknown:
    sys.exit(f"error: --envs names {unknown}; choose from {ENVS}")
  minutes, slots = _MINUTES.value, _SLOTS.value
  if _QUICK.value:
    minutes, slots = 1 / 3, min(slots, 8)
  print(
      f"soak: {psutil.cpu_count()} CPUs, load average "
      f"{', '.join(f'{x:.1f}' for x in psutil.getloadavg())}", flush=True)
  for env in _ENVS.value:
    soak(env, minutes=minutes, episodes=_EPISODES.value, every=_EVERY.value, slots=slots,
         max_steps=_MAX_STEPS.value, backend=_BACKEND.value, junk=_JUNK.value,
         rss_tolerance_mb=_RSS_TOLERANCE_MB.value, warmup=_WARMUP.value)


if __name__ == "__main__":
  app.run(main)
