"""Evaluation: success on a split, per category, with k samples per task (Avg@k and Pass@k).

  Avg@k  = mean over tasks of the fraction of its k samples that succeed
  Pass@k = mean over tasks of whether any of its k samples succeeds
With k = 1 both are the success rate the paper reports.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import jax
import numpy as np

from agentgym_jax import rollout
from agentgym_jax.models.tokenizer import ChatTemplate
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool


def evaluate(
    sampler: Sampler, params: Any, pool: EnvPool, chat: ChatTemplate, task_ids: Sequence[int], *,
    samples_per_task: int, horizon: int, sampling: rollout.TurnSampling, max_context: int,
    key: jax.Array, rows_per_batch: int, groups: int = 1,
    progress: Callable[[int, int], None] | None = None
) -> tuple[dict[str, Any], list[rollout.Trajectory]]:
  """Plays every task `samples_per_task` times, `rows_per_batch` episodes at once in `groups`
  pipelined groups (`rollout.collect`); returns (summary, trajectories). `progress(done, total)`
  is called with the episodes played after each batch."""
  plays = [
      (task_id, index) for index, task_id in enumerate(task_ids) for _ in range(samples_per_task)
  ]
  trajectories: list[rollout.Trajectory] = []
  for start in range(0, len(plays), rows_per_batch):
    chunk = plays[start:start + rows_per_batch]
    played, _ = rollout.collect(sampler, params, pool, chat, chunk, horizon=horizon,
                                sampling=sampling, max_context=max_context,
                                key=jax.random.fold_in(key, start), groups=min(groups, len(chunk)))
    trajectories.extend(played)
    if progress is not None:
      progress(len(trajectories), len(plays))
  return summarize(trajectories, task_categories(pool, task_ids)), trajectories


def as_metrics(summary: dict[str, Any]) -> dict[str, float]:
  """Flat metrics of a summary: eval/success (Avg@k), eval/pass@k, eval/turns, per category."""
  out = {
      "eval/success": summary["avg@k"], "eval/pass@k": summary["pass@k"],
      "eval/turns": summary["turns"]
  }
  for name, stats in summary["categories"].items():
    out[f"eval/success/{name}"] = stats["avg@k"]
  return out


def task_categories(pool: EnvPool, task_ids: Sequence[int]) -> dict[int, str]:
  return {task_id: str(pool.task_info(task_id).get("category", "all")) for task_id in task_ids}


def summarize(trajectories: Sequence[rollout.Trajectory], categories: dict[int,
                                                                           str]) -> dict[str, Any]:
  """Avg@k, Pass@k, mean turns and termination counts, overall and per category."""
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

  tasks = sorted(by_task)
  summary = stats(tasks)
  summary["k"] = len(trajectories) // max(len(tasks), 1)
  per_category: dict[str, list[int]] = collections.defaultdict(list)
  for task_id in tasks:
    per_category[categories.get(task_id, "all")].append(task_id)
  summary["categories"] = {name: stats(ids) for name, ids in sorted(per_category.items())}
  return summary


def format_table(summary: dict[str, Any]) -> str:
  """A plain-text table: one row per category and the total, under a line that says what k is."""
  k = summary["k"]
  header = f"{'category':<24} {'tasks':>6} {f'avg@{k}':>7} {f'pass@{k}':>7} {'turns':>6}"
  lines = [
      f"k = {k} sample{'s' if k != 1 else ''} per task: avg@{k} is the mean success of "
      f"a task's {k}, pass@{k} the share of tasks solved at least once", header, "-" * len(header)
  ]
  rows = list(summary["categories"].items()) + [("all", summary)]
  for name, s in rows:
    lines.append(f"{name:<24} {s['num_tasks']:>6} {100 * s['avg@k']:>6.2f}% "
                 f"{100 * s['pass@k']:>6.2f}% {s['turns']:>6.2f}")
  return "\n".join(lines)
