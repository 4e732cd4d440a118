r"""Trains an LLM agent with multi-turn RL.

  python launch/train.py --config=configs/grpo_textcraft.py:local --workdir=runs/local
  python launch/train.py --config=configs/grpo_textcraft.py --config.optim.learning_rate=2e-6

A workdir that holds checkpoints is resumed from its newest complete one.

On several processes (hosts) every process runs the same command with its own --process_id;
process 0 serves as the coordinator and writes the workdir's files (README: Multi-host):

  python launch/train.py --config=... --coordinator=host0:1234 --num_processes=2 --process_id=0
  python launch/train.py --config=... --coordinator=host0:1234 --num_processes=2 --process_id=1

Cloud TPU pods need none of these flags (JAX finds its peers), nor do runs that set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID.
"""

import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from agentgym_jax import cli, offline, pipeline, sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Checkpoints, metrics, trajectories.")
_COORDINATOR = flags.DEFINE_string("coordinator", None,
                                   "host:port of process 0, for a run on several processes.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0..num_processes-1.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  workdir = cli.check_workdir(_WORKDIR.value)
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if _CONFIG.value.mode != "rl" and jax.process_count() > 1:
    sys.exit(f"error: mode={_CONFIG.value.mode} runs on one process; only RL is multi-process")
  if _CONFIG.value.mode != "rl":
    offline.train_offline(_CONFIG.value, workdir)
  else:
    pipeline.train(_CONFIG.value, workdir)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  cli.run(main)
