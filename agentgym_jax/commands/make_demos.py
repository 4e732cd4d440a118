"""agentgym-demos: writes verified demonstrations (one conversation per line) for SFT and DPO.

From an environment's expert (TextCraft oracle, BabyAI bot, SciWorld gold paths, SearchQA's
hops), in either action format (--action_format=tool_call: replies call the env's tools, and
each record carries the tools' schemas):
  agentgym-demos --env=textcraft --split=train \\
      --out=data/textcraft_train_demos.jsonl [--max_depth=2] [--limit=N] [--action_format=...]

From a run's logged trajectories, those with reward >= --min_reward (and success):
  agentgym-demos --env=textcraft --from_rollouts=/tmp/run --min_reward=1.0 \\
      --out=data/textcraft_rollout_demos.jsonl

(From a checkout, `python launch/make_demos.py` with the same flags.) Either way every
conversation is replayed through the environment and kept only if it succeeds
(agentgym_jax/demonstrations.py); only tasks of --split are used, so test tasks never leak into
training data. --out is checked before any task is played.
"""

import functools
import time

from absl import app, flags, logging

import environments
from agentgym_jax import cli, demonstrations, metrics, paths
from environments import jsonl
from environments.babyai import expert as babyai_expert

_ENV = flags.DEFINE_string(
    "env", None, "Environment: textcraft, babyai, sciworld or searchqa "
    "(any registered one with --from_rollouts).", required=True)
_ACTION_FORMAT = flags.DEFINE_enum(
    "action_format", "react", list(environments.base.ACTION_FORMATS),
    "How replies carry actions: ReAct text, or calls of the env's tools.")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "test"], "Tasks to demonstrate.")
_OUT = flags.DEFINE_string("out", None, "Output JSONL file (a local or gs:// path).", required=True)
_MAX_DEPTH = flags.DEFINE_integer("max_depth", None,
                                  "TextCraft: only goals of crafting depth <= this.", lower_bound=1)
_LIMIT = flags.DEFINE_integer("limit", 0, "Demonstrate only the first N tasks (0: all).",
                              lower_bound=0)
_FROM_ROLLOUTS = flags.DEFINE_string(
    "from_rollouts", None, "A run directory: replay its logged trajectories instead of an "
    "expert.")
_MIN_REWARD = flags.DEFINE_float("min_reward", 1.0,
                                 "--from_rollouts: keep trajectories with at least this reward.")
_REQUIRE_SUCCESS = flags.DEFINE_bool("require_success", True,
                                     "--from_rollouts: keep only trajectories that succeeded.")
_HIGH_LEVEL = flags.DEFINE_bool(
    "high_level", True, "BabyAI: shorten the bot's primitive moves into high-level actions.")


def _tasks(env: environments.Env) -> list[int]:
  task_ids = list(env.task_ids(_SPLIT.value))
  if _MAX_DEPTH.value is not None:
    if "depth" not in env.task_info(task_ids[0]):
      raise app.UsageError(f"--max_depth: {env.name} tasks have no crafting depth")
    task_ids = [t for t in task_ids if env.task_info(t)["depth"] <= _MAX_DEPTH.value]
  return task_ids[:_LIMIT.value] if _LIMIT.value else task_ids


def _make_demos() -> None:
  cli.check_env_name(_ENV.value)
  if _FROM_ROLLOUTS.value is None:
    try:
      source, expert = demonstrations.expert_for(_ENV.value)
    except ValueError as error:
      raise app.UsageError(f"--env={_ENV.value}: {error}") from None
    if _ENV.value == "babyai" and not _HIGH_LEVEL.value:
      expert = functools.partial(babyai_expert.replies, high_level=False)
  else:
    cli.check_run_directory(_FROM_ROLLOUTS.value, f"--from_rollouts={_FROM_ROLLOUTS.value}")
  options = {} if _ACTION_FORMAT.value == "react" else {"action_format": _ACTION_FORMAT.value}
  if options and _ENV.value not in environments.base.TOOL_CALL_ENVS:
    raise app.UsageError(f"--action_format={_ACTION_FORMAT.value}: {_ENV.value} publishes no "
                         "tools")
  cli.check_output_file(_OUT.value, f"--out={_OUT.value}")
  env = environments.make(_ENV.value, **options)
  try:
    task_ids = _tasks(env)
    start = time.perf_counter()
    if _FROM_ROLLOUTS.value is not None:
      wanted = set(task_ids)
      records = [
          r for r in metrics.read_trajectories(_FROM_ROLLOUTS.value) if r.get("task_id") in wanted
      ]
      logging.info("%d logged trajectories of %s tasks", len(records), _SPLIT.value)
      result = demonstrations.from_rollouts(records, env, min_reward=_MIN_REWARD.value,
                                            require_success=_REQUIRE_SUCCESS.value)
    else:
      result = demonstrations.Demonstrations()
      for count, task_id in enumerate(task_ids, start=1):
        record, reason = demonstrations.demonstrate(env, task_id, expert, source)
        if record is None:
          result.rejected.append((task_id, reason))
          logging.info("task %d: no demonstration (%s)", task_id, reason)
        else:
          result.demos.append(record)
        if count % 50 == 0 or count == len(task_ids):
          logging.info("%d/%d tasks, %d demonstrations, %.0f s", count, len(task_ids),
                       len(result.demos),
                       time.perf_counter() - start)
  finally:
    env.close()
  paths.replace_file(_OUT.value, "".join(map(jsonl.to_line, result.demos)))
  print(result.summary())
  print(f"wrote {len(result.demos)} demonstrations to {_OUT.value}")


def main() -> None:
  """agentgym-demos."""
  cli.run(_make_demos)
