"""The whole recipe of a run: an optional SFT warm start on verified expert demonstrations, then
RL from the warm-started policy, with (eval.stages) an evaluation of each stage's policy.

    workdir/warm_start/demos.jsonl    the demonstrations (made once with the environment's expert
                                      over its train tasks, or copied from warm_start.demonstrations)
    workdir/warm_start/               the SFT run: its checkpoints, metrics and export
    workdir/                          the RL run, starting from workdir/warm_start/export
    workdir/evaluation/<stage>.json   eval.stages: the summary of each stage's policy (initial,
                                      warm start, RL) on eval.split, played as evaluations are,
                                      with every task's samples
    workdir/evaluation/table.txt      and the table of all of them, also printed at the end,
                                      each stage against the one before task by task
    eval.cache_dir/<fingerprint>.json every summary played, by evaluation.fingerprint

Each stage resumes by itself (the SFT run from its checkpoints, RL from its own), so a run
stopped anywhere, mid-warm-start included, continues where it was when started again. A stage
that has finished is not run again: the warm start is done once its export exists, an
evaluation once its summary exists. Nor is a policy played again on the same evaluation in any
workdir: its summary is copied from eval.cache_dir when the same model files were evaluated with
the same settings (`evaluation_settings`) before, as the initial policy is on every run of a
config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
import time
from typing import Any, Callable

import jax
import ml_collections
from absl import logging

from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import state as state_lib
from agentgym_jax import paths
from agentgym_jax import demonstrations, evaluation, metrics, multihost, offline, rollout
from agentgym_jax import sharding, trainer
from agentgym_jax.models import attention
from environments import base, jsonl

WARM_START_DIR = "warm_start"
EVALUATION_DIR = "evaluation"


def train(c: ml_collections.ConfigDict | settings_lib.Settings,
          workdir: str | pathlib.Path) -> list[dict[str, Any]]:
  """Runs (or resumes) the warm start, if warm_start.steps > 0, then RL, each stage's policy
  evaluated if eval.stages; returns RL's metrics. `c` is the run's config (validated once,
  here) or its settings."""
  settings = settings_lib.Settings.of(c)
  workdir = paths.path(workdir)
  summaries = {}

  def evaluate(stage: str, policy: str) -> None:
    if settings.evaluation.stages:
      path = workdir / EVALUATION_DIR / f"{stage.replace(' ', '_').lower()}.json"
      summaries[stage] = evaluate_stage(settings, stage, policy, path)

  evaluate("initial", settings.model.name)
  if settings.warm_start.steps:
    policy = warm_start(settings, workdir / WARM_START_DIR)
    evaluate("warm start", str(policy))
    settings = settings.with_model(str(policy))
  history = trainer.train(settings, workdir)
  evaluate("RL", str(workdir / "export"))
  if summaries:
    table = stage_table(summaries)
    (workdir / EVALUATION_DIR / "table.txt").write_text(table + "\n")
    print(table, flush=True)
  return history


def evaluate_policy(
    settings: settings_lib.Settings, model_name: str | None, rows: int,
    start: Callable[[int], Callable[[int, int], None]] | None = None
) -> tuple[dict[str, Any], list[rollout.Trajectory]]:
  """(summary, trajectories): the policy `model_name` (the config's by default) played on
  settings.evaluation's tasks, `rows` episodes at a time, seeded with the run's seed.
  `start(tasks)`, if given, is called before the first episode and returns the progress
  callback, called with (episodes done, episodes) as episodes end."""
  plan = settings.evaluation
  mesh, model, tokenizer = state_lib.load_policy(settings, model_name)
  sampler = settings.rollout.sampler(model, mesh, rows)
  with settings.env.pool(rows) as pool:
    task_ids = plan.tasks(pool)
    player = settings.rollout.player(sampler, sampler.params, pool, settings.model.chat(tokenizer),
                                     plan.sampling)
    return evaluation.evaluate(player, task_ids, samples_per_task=plan.samples_per_task,
                               horizon=plan.horizon, key=jax.random.key(settings.seed),
                               rows_per_batch=rows,
                               progress=start(len(task_ids)) if start else None,
                               judge=settings.make_judge())


def evaluate_stage(settings: settings_lib.Settings, stage: str, policy: str,
                   path: pathlib.Path) -> dict[str, Any]:
  """The summary of the `stage` policy `policy` on the evaluation, kept at `path` (read, if
  there, instead of played again) and in eval.cache_dir (copied from there, if the same model
  files were evaluated with the same settings before). Says on stdout when it starts and what it
  scored, or where the summary was copied from."""
  if path.exists():
    return json.loads(path.read_text())
  plan, started = settings.evaluation, time.monotonic()
  rows = plan.rows or settings.rollout.rows
  cached = cache_entry(settings, policy, rows)
  if cached is not None and cache_hit(cached):
    text = cached.read_text()
    summary = json.loads(text)
    paths.replace_file(path, text)
    print(
        f"reused the {stage} policy's evaluation from {cached} (the same model files and "
        f"evaluation settings): avg@{summary['k']} {100 * summary['avg@k']:.1f}%, "
        f"pass@{summary['k']} {100 * summary['pass@k']:.1f}%", flush=True)
    return summary

  def start(tasks: int) -> Callable[[int, int], None]:
    print(
        f"evaluating the {stage} policy: {tasks} {settings.env.name} tasks of the "
        f"{plan.split} split, k = {plan.samples_per_task}, up to {plan.horizon} turns", flush=True)
    return episodes_done

  printed = [0]

  def episodes_done(done: int, total: int) -> None:
    # A line every `rows` episodes: episodes end one by one when rows are refilled.
    if done < total and done - printed[0] >= rows:
      printed[0] = done
      print(f"  {done}/{total} episodes in {metrics.duration(time.monotonic() - started)}",
            flush=True)

  summary, _ = evaluate_policy(settings, policy, rows, start)
  text = evaluation.to_json(summary)
  paths.replace_file(path, text)
  if cached is not None:
    write_cache_entry(cached, text)
  print(
      f"evaluated the {stage} policy: avg@{summary['k']} {100 * summary['avg@k']:.1f}%, "
      f"pass@{summary['k']} {100 * summary['pass@k']:.1f}%, {summary['turns']:.2f} turns, "
      f"in {metrics.duration(time.monotonic() - started)}", flush=True)
  return summary


def evaluation_settings(settings: settings_lib.Settings, rows: int) -> dict[str, Any]:
  """Every setting that decides what an evaluation of a policy scores, played `rows` episodes at
  a time (`evaluate_policy`): the environment (or a mixture's), its options and action format,
  and its step timeout (a slow step ends an episode); the tasks (split, max_tasks); samples per
  task, turn cap, turn sampling, context, and the seed of sampled turns (greedy decoding draws
  nothing, and an environment's task is its id alone: another seed plays the same episodes); the
  chat (thinking); the numerics (matmul, parameter and
  KV-cache dtypes, attention, mesh, device kind, JAX version); the batches (rows, pipeline
  groups, refill: their episodes' keys, and batch shapes' rounding); and this project's code
  (evaluation.source_fingerprint). Not: what only decides how fast it plays (env.backend,
  eval.every)."""
  model, env, plan = settings.model, settings.env, settings.evaluation
  dtype = model.matmul_dtype()
  implementation, device = attention.choose(model.attention), jax.devices()[0]
  record = {
      "code": evaluation.source_fingerprint(), "env": env.name, "env_options": env.options,
      "action_format": env.action_format, "step_timeout": env.step_timeout, "split": plan.split,
      "max_tasks": plan.max_tasks, "samples_per_task": plan.samples_per_task,
      "horizon": plan.horizon, "sampling": dataclasses.asdict(plan.sampling), "max_context":
          settings.rollout.max_context, "context": dataclasses.asdict(settings.rollout.context),
      "seed": None if plan.sampling.tokens().greedy else settings.seed,
      "thinking": model.thinking == "on", "dtype": dtype, "param_dtype": model.param_dtype,
      "cache_dtype": settings.rollout.cache_dtype or dtype, "attention": implementation,
      "mesh": dict(model.make_mesh().shape
                  ), "device_kind": device.device_kind, "jax": jax.__version__, "rows": rows,
      "pipeline_groups": settings.rollout.pipeline_groups, "refill": settings.rollout.refill
  }
  if env.mixture:  # Its environments as they play; their weights decide only training's draws.
    record["mixture"] = [{
        "label": m.label, "name": m.name, "options": m.options, "max_turns": m.max_turns
    } for m in env.mixture]
  return record


def cache_entry(settings: settings_lib.Settings, policy: str, rows: int) -> paths.Path | None:
  """Where eval.cache_dir keeps the summary of `policy` evaluated with `settings`, `rows`
  episodes at a time: <fingerprint>.json (evaluation.fingerprint); None if eval.cache_dir is
  ""."""
  cache_dir = settings.evaluation.cache_dir
  if not cache_dir:
    return None
  sharding.initialize_distributed()  # Before the settings ask JAX about the devices.
  key = evaluation.fingerprint(policy, evaluation_settings(settings, rows))
  return paths.path(os.path.expanduser(cache_dir)) / f"{key}.json"


def cache_hit(entry: paths.Path) -> bool:
  """Whether `entry` is in the cache, of every process (each may have a cache of its own; they
  play the evaluation together or not at all)."""
  hit = entry.exists()
  if jax.process_count() > 1:
    hit = all(multihost.all_gather_objects(hit))
  return hit


def write_cache_entry(entry: paths.Path, text: str) -> None:
  """Writes `text` at `entry` so that a reader sees a whole summary or none: locally through a
  temporary file of this process's own (processes of one machine may write the same entry at
  once) and a rename, in a bucket as one object."""
  if paths.is_remote(entry):
    paths.replace_file(entry, text)
    return
  entry.parent.mkdir(parents=True, exist_ok=True)
  descriptor, temporary = tempfile.mkstemp(prefix=entry.name, suffix=".tmp", dir=entry.parent)
  with os.fdopen(descriptor, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(temporary, entry)


def stage_table(summaries: dict[str, dict[str, Any]]) -> str:
  """One row per category (of each environment of a mixture, then its total) and the total;
  per stage, Avg@k and Pass@k (in %) of its policy. Below, each stage against the one before,
  task by task (`paired_lines`)."""
  k = next(iter(summaries.values()))["k"]
  stages = list(summaries)
  rows = [dict(evaluation.table_rows(s)) for s in summaries.values()]
  # Each row where the first stage that has it puts it, the total last.
  names = [
      name for name in dict.fromkeys(n for stage_rows in rows for n in stage_rows) if name != "all"
  ] + ["all"]
  header = f"{'category':<16} {'tasks':>5}" + "".join(
      f" {stage + f' avg@{k}':>18} {f'pass@{k}':>7}" for stage in stages)
  lines = [
      f"k = {k} sample{'s' if k != 1 else ''} per task; avg@{k}: mean success of a task's "
      f"{k}, pass@{k}: share of tasks solved at least once", header, "-" * len(header)
  ]
  for name in names:
    stats = [stage_rows.get(name) for stage_rows in rows]
    tasks = next(x["num_tasks"] for x in stats if x is not None)
    cells = "".join(
        f" {100 * x['avg@k']:>17.1f}% {100 * x['pass@k']:>6.1f}%" if x else f" {'-':>18} {'-':>7}"
        for x in stats)
    lines.append(f"{name:<16} {tasks:>5}{cells}")
  pairs = list(zip(stages, stages[1:]))
  if pairs:
    lines.append("")
    for before, after in pairs:
      lines.extend(paired_lines(before, after, summaries[before], summaries[after]))
  return "\n".join(lines)


def paired_lines(before: str, after: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
  """Stage `after` against stage `before` on the same tasks (evaluation.compare): the tasks it
  gained and lost, the sign test's exact two-sided p-value, and with several categories the
  gains and losses of each; or why there is no comparison (a summary without per-task
  records, or of other tasks)."""
  lacking = [stage for stage, summary in ((before, a), (after, b)) if "tasks" not in summary]
  if lacking:
    return [
        f"{before} -> {after}: the paired test needs per-task records; the summary of "
        f"{' and of '.join(lacking)} has none (written before they were kept; delete it to "
        "evaluate again)"
    ]
  try:
    paired = evaluation.compare(a, b)
  except ValueError as error:
    return [f"{before} -> {after}: no paired test: {error}"]
  lines = [
      f"{before} -> {after}: +{paired.gained} gained, -{paired.lost} lost of {paired.num_tasks} "
      f"tasks (paired sign test, exact two-sided p = {float(paired.p_value):.2g})"
  ]
  names = {task["category"] for task in b["tasks"]}
  if len(names) > 1:
    counts = [paired.categories.get(name, (0, 0)) for name in sorted(names)]
    lines.append("  by category: " + ", ".join(
        f"{name} +{gained} -{lost}" for name, (gained, lost) in zip(sorted(names), counts)))
  return lines


def warm_start(settings: settings_lib.Settings, directory: paths.Path) -> paths.Path:
  """SFT of the run's policy on demonstrations of its environment (`Settings.warm_start_run`);
  returns the exported policy."""
  export = directory / "export"
  if (export / "config.json").exists():
    return export
  offline.train_offline(settings.warm_start_run(demonstrations_file(settings, directory)),
                        directory)
  return export


def demonstrations_file(settings: settings_lib.Settings, directory: paths.Path) -> paths.Path:
  """warm_start.demonstrations, or the environment expert's verified demonstrations of up to
  warm_start.max_tasks train tasks, made once and kept in `directory` (either local or gs://)."""
  w, env_settings = settings.warm_start, settings.env
  if w.demonstrations:
    return paths.path(w.demonstrations)
  path = directory / "demos.jsonl"
  if path.exists():
    return path
  env = base.make(env_settings.name, **env_settings.options)
  try:
    task_ids = list(env.task_ids("train"))
    if w.max_tasks:
      task_ids = task_ids[:w.max_tasks]
    made = demonstrations.demonstrate_tasks(env, task_ids)
  finally:
    env.close()
  if not made.demos:
    raise config_lib.ConfigError(
        f"invalid config: the {env_settings.name} expert solved none of {len(task_ids)} train "
        f"tasks, so there is nothing to warm-start on ({made.rejected[:3]})")
  logging.info("warm start: %d demonstrations of %d tasks", len(made.demos), len(task_ids))
  paths.replace_file(path, "".join(map(jsonl.to_line, made.demos)))
  return path
