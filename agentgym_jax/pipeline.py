"""The whole recipe of a run: an optional SFT warm start on verified expert demonstrations, then
RL from the warm-started policy.

    workdir/warm_start/demos.jsonl    the demonstrations (made once with the environment's expert
                                      over its train tasks, or copied from warm_start.demonstrations)
    workdir/warm_start/               the SFT run: its checkpoints, metrics and export
    workdir/                          the RL run, starting from workdir/warm_start/export

Each stage resumes by itself (the SFT run from its checkpoints, RL from its own), so a run
stopped anywhere, mid-warm-start included, continues where it was when started again. A stage
that has finished is not run again: the warm start is done once its export exists.
"""

from __future__ import annotations

import pathlib
from typing import Any

import ml_collections
from absl import logging

from agentgym_jax import config as config_lib
from agentgym_jax import demonstrations, offline, trainer
from environments import base, jsonl

WARM_START_DIR = "warm_start"


def train(c: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> list[dict[str, Any]]:
  """Runs (or resumes) the warm start, if warm_start.steps > 0, then RL; returns RL's metrics."""
  c = config_lib.validate(c)
  workdir = pathlib.Path(workdir)
  if c.warm_start.steps:
    policy = warm_start(c, workdir / WARM_START_DIR)
    c = ml_collections.ConfigDict(c.to_dict())
    c.model.name = str(policy)
  return trainer.train(c, workdir)


def warm_start(c: ml_collections.ConfigDict, directory: pathlib.Path) -> pathlib.Path:
  """SFT of c's policy on demonstrations of c's environment; returns the exported policy."""
  export = directory / "export"
  if (export / "config.json").exists():
    return export
  sft = sft_config(c, demonstrations_file(c, directory))
  offline.train_offline(sft, directory)
  return export


def demonstrations_file(c: ml_collections.ConfigDict, directory: pathlib.Path) -> pathlib.Path:
  """warm_start.demonstrations, or the environment expert's verified demonstrations of up to
  warm_start.max_tasks train tasks, made once and kept in `directory`."""
  if c.warm_start.demonstrations:
    return pathlib.Path(c.warm_start.demonstrations)
  path = directory / "demos.jsonl"
  if path.exists():
    return path
  env = base.make(c.env.name, **c.env.options.to_dict())
  try:
    task_ids = list(env.task_ids("train"))
    if c.warm_start.max_tasks:
      task_ids = task_ids[:c.warm_start.max_tasks]
    made = demonstrations.collect(env, task_ids)
  finally:
    env.close()
  if not made.demos:
    raise config_lib.ConfigError(
        f"invalid config: the {c.env.name} expert solved none of {len(task_ids)} train tasks, "
        f"so there is nothing to warm-start on ({made.rejected[:3]})")
  logging.info("warm start: %d demonstrations of %d tasks", len(made.demos), len(task_ids))
  jsonl.write(path, made.demos)
  return path


def sft_config(c: ml_collections.ConfigDict, data: pathlib.Path) -> ml_collections.ConfigDict:
  """The warm start's SFT run: c's policy, environment and logging, warm_start's schedule."""
  sft = ml_collections.ConfigDict(c.to_dict())
  w = c.warm_start
  sft.mode = "sft"
  sft.warm_start.steps = 0
  sft.steps = w.steps
  sft.data.path = str(data)
  sft.data.batch_size = w.batch_size
  sft.data.max_length = c.rollout.max_context
  sft.optim.learning_rate = w.learning_rate
  sft.optim.schedule = "constant"
  sft.optim.warmup_steps = 0
  sft.checkpoint.export_hf = True
  sft.eval.every = 0
  return config_lib.validate(sft)
