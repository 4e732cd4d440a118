"""Evaluation: success on a split, per category, with k samples per task (Avg@k and Pass@k),
the paired comparison of two evaluations of the same tasks, and what identifies an evaluation.

  Avg@k  = mean over tasks of the fraction of its k samples that succeed
  Pass@k = mean over tasks of whether any of its k samples succeeds
With k = 1 both are the success rate the paper reports. A summary also keeps every task's
samples (`tasks`: success, reward and turns of each), which two evaluations of the same tasks
are compared on task by task (`compare`, an exact sign test), and an evaluation is identified
by its `fingerprint`: the bytes of the policy's files and the settings that decide its outcome.
"""

from __future__ import annotations

import collections
import dataclasses
import fractions
import functools
import hashlib
import json
import math
import pathlib
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

import agentgym_jax
import environments
from agentgym_jax import paths, rollout
from agentgym_jax.models import gguf, lora, resolve
from environments.mixture import MixturePool
from environments.pool import EnvPool


def evaluate(
    player: rollout.Player, task_ids: Sequence[int], *, samples_per_task: int, horizon: int,
    key: jax.Array, rows_per_batch: int, progress: Callable[[int, int], None] | None = None,
    judge: Callable[[Sequence[rollout.Trajectory]], float] | None = None
) -> tuple[dict[str, Any], list[rollout.Trajectory]]:
  """Plays every task `samples_per_task` times with `player`, `rows_per_batch` episodes at once
  in the player's pipelined groups (`rollout.collect`); returns (summary, trajectories). With
  `player.refill` a row takes the next episode as soon as its own ends (episode j draws from
  fold_in(key, turn) and j); otherwise batch by batch, batch b's keys from fold_in(key,
  b x rows_per_batch). `progress(done, total)` is called with the episodes played as they end
  (after each batch without refill). A `judge` (agentgym_jax/judge.py) scores the episodes
  before they are summarised."""
  plays = [
      (task_id, index) for index, task_id in enumerate(task_ids) for _ in range(samples_per_task)
  ]
  if player.refill and plays:
    rows = min(rows_per_batch, len(plays))
    report = None if progress is None else lambda done: progress(done, len(plays))
    trajectories, _ = rollout.collect(player.in_groups(rows), plays, horizon=horizon, key=key,
                                      rows=rows, progress=report)
  else:
    trajectories = []
    for start in range(0, len(plays), rows_per_batch):
      chunk = plays[start:start + rows_per_batch]
      played, _ = rollout.collect(player.in_groups(len(chunk)), chunk, horizon=horizon,
                                  key=jax.random.fold_in(key, start))
      trajectories.extend(played)
      if progress is not None:
        progress(len(trajectories), len(plays))
  if judge is not None:
    judge(trajectories)
  return summarize(trajectories, task_categories(player.pool, task_ids)), trajectories


def as_metrics(summary: dict[str, Any]) -> dict[str, float]:
  """Flat metrics of a summary: eval/success (Avg@k), eval/pass@k, eval/turns, per category,
  and per environment of a mixture (eval/success/<environment>)."""
  out = {
      "eval/success": summary["avg@k"], "eval/pass@k": summary["pass@k"],
      "eval/turns": summary["turns"]
  }
  for name, stats in summary["categories"].items():
    out[f"eval/success/{name}"] = stats["avg@k"]
  for name, stats in summary.get("environments", {}).items():
    out[f"eval/success/{name}"] = stats["avg@k"]
  return out


def task_categories(pool: EnvPool | MixturePool, task_ids: Sequence[int]) -> dict[int, str]:
  return {task_id: str(pool.task_info(task_id).get("category", "all")) for task_id in task_ids}


def summarize(trajectories: Sequence[rollout.Trajectory], categories: dict[int,
                                                                           str]) -> dict[str, Any]:
  """Avg@k, Pass@k, mean turns and termination counts, overall and per category, and `tasks`:
  per task in task-id order, its category and the success (1.0 or 0.0), reward and turns of
  each of its samples in the order they were played. Episodes of several environments (a
  mixture's) are also summarised per environment (`environments`: each with its categories),
  and each task's record names its environment (`env`)."""
  by_task: dict[int, list[rollout.Trajectory]] = collections.defaultdict(list)
  for trajectory in trajectories:
    by_task[trajectory.task_id].append(trajectory)

  def stats(task_ids: Sequence[int]) -> dict[str, Any]:
    runs = [by_task[t] for t in task_ids]
    flat = [t for run in runs for t in run]
    return {
        "num_tasks": len(task_ids),
        "avg@k": float(np.mean([np.mean([t.success for t in run]) for run in runs])),
        "pass@k": float(np.mean([any(t.success for t in run) for run in runs])),
        "reward": float(np.mean([t.reward for t in flat])),
        "turns": float(np.mean([t.num_turns for t in flat])),
        "terminations": dict(collections.Counter(t.termination for t in flat)),
    }

  def per_category(task_ids: Sequence[int]) -> dict[str, dict[str, Any]]:
    grouped: dict[str, list[int]] = collections.defaultdict(list)
    for task_id in task_ids:
      grouped[categories.get(task_id, "all")].append(task_id)
    return {name: stats(ids) for name, ids in sorted(grouped.items())}

  tasks = sorted(by_task)
  summary = stats(tasks)
  summary["k"] = len(trajectories) // max(len(tasks), 1)
  summary["categories"] = per_category(tasks)
  environments: dict[str, list[int]] = collections.defaultdict(list)
  for task_id in tasks:
    environments[by_task[task_id][0].env].append(task_id)
  mixed = len(environments) > 1
  if mixed:
    summary["environments"] = {
        name: {**stats(ids), "categories": per_category(ids)} for name, ids in environments.items()
    }
  summary["tasks"] = [
      task_record(task_id, categories.get(task_id, "all"), by_task[task_id],
                  by_task[task_id][0].env if mixed else None) for task_id in tasks
  ]
  return summary


def task_record(task_id: int, category: str, samples: Sequence[rollout.Trajectory],
                env: str | None = None) -> dict[str, Any]:
  """A task's entry in a summary's `tasks`: the success (1.0 or 0.0), reward and turns of each
  of its samples, in the order they were played; and its environment `env`, if given (of a
  mixture)."""
  record: dict[str, Any] = {"task_id": int(task_id)}
  if env is not None:
    record["env"] = env
  record.update(category=category, success=[float(t.success) for t in samples],
                reward=[t.reward for t in samples], turns=[t.num_turns for t in samples])
  return record


def table_rows(summary: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
  """The rows of a summary's table, (name, statistics) in order: its categories, or for each
  environment of a mixture its categories and then its total (named by the environment); last
  the total of all ("all")."""
  if "environments" not in summary:
    return [*summary["categories"].items(), ("all", summary)]
  rows: list[tuple[str, Mapping[str, Any]]] = []
  for name, stats in summary["environments"].items():
    rows.extend(stats["categories"].items())
    rows.append((name, stats))
  return [*rows, ("all", summary)]


def to_json(summary: Mapping[str, Any]) -> str:
  """A summary as indented JSON, each record of its `tasks` on one line of its own."""
  others = json.dumps({key: value for key, value in summary.items() if key != "tasks"}, indent=2)
  if "tasks" not in summary:
    return others
  tasks = ",\n".join(f"    {json.dumps(task)}" for task in summary["tasks"])
  return f'{others[:-2]},\n  "tasks": [\n{tasks}\n  ]\n}}'


def format_table(summary: dict[str, Any]) -> str:
  """A plain-text table: one row per category (of each environment of a mixture, then its
  total) and the total, under a line that says what k is."""
  k = summary["k"]
  header = f"{'category':<24} {'tasks':>6} {f'avg@{k}':>7} {f'pass@{k}':>7} {'turns':>6}"
  lines = [
      f"k = {k} sample{'s' if k != 1 else ''} per task: avg@{k} is the mean success of "
      f"a task's {k}, pass@{k} the share of tasks solved at least once", header, "-" * len(header)
  ]
  for name, s in table_rows(summary):
    lines.append(f"{name:<24} {s['num_tasks']:>6} {100 * s['avg@k']:>6.2f}% "
                 f"{100 * s['pass@k']:>6.2f}% {s['turns']:>6.2f}")
  return "\n".join(lines)


# --- two evaluations of the same tasks, compared task by task -------------------------------


@dataclasses.dataclass(frozen=True)
class PairedComparison:
  """Evaluation B against evaluation A on the same tasks: `gained` tasks whose mean success is
  higher in B, `lost` tasks whose mean success is lower, of `num_tasks`; `categories` maps each
  category to its (gained, lost); `p_value` is the exact two-sided sign test's (`sign_test`)."""

  gained: int
  lost: int
  num_tasks: int
  categories: dict[str, tuple[int, int]]
  p_value: fractions.Fraction


def sign_test(gained: int, lost: int) -> fractions.Fraction:
  """The exact two-sided p-value of a sign test of `gained` against `lost` (ties dropped); with
  one sample per task (success 0 or 1) it is the exact McNemar test.

  Under H0 (neither evaluation is better) each of the n = gained + lost untied tasks is gained
  with probability 1/2, so gained ~ Binomial(n, 1/2), and

    p = min(1, 2 * sum_{i=0}^{min(gained, lost)} C(n, i) / 2^n),   p = 1 when n = 0.

  E.g. 8 gained, 1 lost: 2 * (C(9, 0) + C(9, 1)) / 2^9 = 20 / 512 = 0.0390625. The sum is
  exact (integers and a Fraction), so tiny p-values do not underflow to 0 or round up.
  """
  if gained < 0 or lost < 0:
    raise ValueError(f"gained={gained} and lost={lost} must be >= 0")
  n = gained + lost
  tail = sum(math.comb(n, i) for i in range(min(gained, lost) + 1))
  return min(fractions.Fraction(1), fractions.Fraction(2 * tail, 2**n))


def task_success(summary: Mapping[str, Any]) -> dict[int, fractions.Fraction]:
  """Each task's mean success over its samples (with one sample: 1 solved, 0 not), exactly,
  from a summary's per-task records."""
  if "tasks" not in summary:
    raise ValueError("the summary has no per-task records (`tasks`); evaluate again to compare")
  mean = lambda values: sum(map(fractions.Fraction, values), fractions.Fraction(0)) / len(values)
  return {int(task["task_id"]): mean(task["success"]) for task in summary["tasks"]}


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> PairedComparison:
  """Evaluation `b` against `a`, task by task (`PairedComparison`); their tasks must be the same.
  Each task's category is b's."""
  success_a, success_b = task_success(a), task_success(b)
  tasks_a, tasks_b = success_a.keys(), success_b.keys()
  if tasks_a != tasks_b:
    only_a, only_b = sorted(tasks_a - tasks_b), sorted(tasks_b - tasks_a)
    raise ValueError(f"the evaluations are of different tasks ({len(only_a)} only in the first, "
                     f"e.g. {only_a[:3]}; {len(only_b)} only in the second, e.g. {only_b[:3]})")
  counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for task in b["tasks"]:
    before, after = success_a[int(task["task_id"])], success_b[int(task["task_id"])]
    if after != before:
      counts[task["category"]][0 if after > before else 1] += 1
  gained, lost = (sum(c[i] for c in counts.values()) for i in (0, 1))
  return PairedComparison(gained=gained, lost=lost, num_tasks=len(success_b),
                          categories={name: (c[0], c[1]) for name, c in sorted(counts.items())},
                          p_value=sign_test(gained, lost))


# --- what identifies an evaluation ----------------------------------------------------------

# The files of a model directory that loading reads: config, weights, tokenizer, chat template.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".gguf", ".jinja")
# sha256 of each file hashed in this process, by (path, size, modification time).
_file_digests: dict[tuple[str, int, int], str] = {}


def model_files(spec: str) -> list[pathlib.Path]:
  """The files `load_model(spec)` builds the policy from: for a directory (a checkpoint, a
  registry model's, a Hub snapshot, a bucket directory's local copy) its config, weights,
  tokenizer and chat template files (MODEL_FILE_SUFFIXES) in name order; for the embedded
  SmolLM2 its GGUF file; for a PEFT adapter directory its files, then its base model's."""
  if not paths.is_remote(spec) and lora.is_peft(spec):
    return _directory_files(pathlib.Path(spec).expanduser()) + model_files(lora.peft_base(spec))
  directory = resolve(spec)
  if directory is None:
    return [gguf.smollm2_gguf_path()]
  return _directory_files(directory)


def _directory_files(directory: pathlib.Path) -> list[pathlib.Path]:
  return sorted(f for f in directory.iterdir() if f.suffix in MODEL_FILE_SUFFIXES and f.is_file())


def file_digest(path: pathlib.Path) -> str:
  """The sha256 of a file's bytes, read once per process while its size and modification time
  stay the same."""
  stat = path.stat()
  key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
  if key not in _file_digests:
    with open(path, "rb") as f:
      _file_digests[key] = hashlib.file_digest(f, "sha256").hexdigest()
  return _file_digests[key]


def model_fingerprint(spec: str) -> str:
  """sha256 over the names and bytes of the policy's files (`model_files`): the same weights
  copied elsewhere have the same fingerprint, one changed byte another."""
  lines = "".join(f"{f.name} {file_digest(f)}\n" for f in model_files(spec))
  return hashlib.sha256(lines.encode()).hexdigest()


@functools.cache
def source_fingerprint() -> str:
  """sha256 over the names and bytes of this project's Python sources (the agentgym_jax and
  environments packages): a change to the sampler, the rollout or an environment's rules can
  change what a policy scores, so an evaluation cached by other code is not reused."""
  digest = hashlib.sha256()
  for package in (agentgym_jax, environments):
    root = pathlib.Path(package.__file__).parent
    for source in sorted(root.rglob("*.py")):
      digest.update(f"{source.relative_to(root.parent)}\n".encode())
      digest.update(source.read_bytes())
  return digest.hexdigest()


def fingerprint(model: str, settings: Mapping[str, Any]) -> str:
  """The key of an evaluation: sha256 over the model's fingerprint and the JSON of `settings`
  (what decides the evaluation's outcome; recipe.evaluation_settings)."""
  record = {"model": model_fingerprint(model), "settings": settings}
  return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
