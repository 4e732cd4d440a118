r"""agentgym-train: trains an LLM agent with multi-turn RL (or SFT / DPO: the config's mode).

  agentgym-train --config=grpo_textcraft:local --workdir=runs/local
  agentgym-train --config=grpo_textcraft --config.optim.learning_rate=2e-6
  agentgym-train --config=my_config.py:variant --workdir=runs/mine
  agentgym-train --config=grpo_textcraft:local --print_config

(From a checkout, `python launch/train.py` with the same flags.) --config is a packaged
config's name (the repository's configs/) or a config file, its variants after a colon;
--config.KEY=VALUE overrides a key. A workdir that holds checkpoints is resumed from its
newest complete one.

On several processes (hosts) every process runs the same command with its own --process_id;
process 0 serves as the coordinator and writes the workdir's files (docs/multihost.md):

  agentgym-train --config=... --coordinator=host0:1234 --num_processes=2 --process_id=0
  agentgym-train --config=... --coordinator=host0:1234 --num_processes=2 --process_id=1

Cloud TPU pods need none of these flags (JAX finds its peers), nor do runs that set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.
"""

import os

import jax
from absl import app, flags

from agentgym_jax import cli, offline, recipe, sharding
from agentgym_jax import settings as settings_lib

_CONFIG = cli.define_config()
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, metrics, trajectories.")
_COORDINATOR = flags.DEFINE_string("coordinator", None,
                                   "host:port of process 0, for a run on several processes.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run.",
                                      lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.",
                                   lower_bound=0)


def _check_processes() -> None:
  """The multi-process flags (or their JAX_* variables) agree: a coordinator's host:port, a
  process count and this process's index below it."""
  coordinator = _COORDINATOR.value or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not coordinator:
    if _NUM_PROCESSES.value is not None or _PROCESS_ID.value is not None:
      raise app.UsageError("--num_processes and --process_id need --coordinator=host:port "
                           "(process 0's)")
    return
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise app.UsageError(f"--coordinator={coordinator} is not host:port")
  values = {}
  for flag, variable in ((_NUM_PROCESSES, "JAX_NUM_PROCESSES"), (_PROCESS_ID, "JAX_PROCESS_ID")):
    value = flag.value if flag.value is not None else os.environ.get(variable)
    if value is None or not str(value).isdigit():
      raise app.UsageError(f"--coordinator needs --{flag.name} (or {variable}), got {value!r}")
    values[flag.name] = int(value)
  count, index = values["num_processes"], values["process_id"]
  if not 0 <= index < count:
    raise app.UsageError(f"--process_id={index} must be in [0, --num_processes={count})")


def _train() -> None:
  workdir = cli.check_workdir(_WORKDIR.value)
  _check_processes()
  # Before the settings, whose defaults ask JAX for its backend.
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  settings = settings_lib.Settings.from_config(_CONFIG.value)
  if settings.mode != "rl" and jax.process_count() > 1:
    raise app.UsageError(f"mode={settings.mode} runs on one process; only RL is multi-process")
  if settings.mode != "rl":
    offline.train_offline(settings, workdir)
  else:
    recipe.train(settings, workdir)


def main() -> None:
  """agentgym-train."""
  cli.run(_train)
