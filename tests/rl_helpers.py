"""Helpers shared by the training tests: the echo run, conversations and JSONL files, config keys
set and checked by name, a run stopped and resumed, exported weights compared, the launcher."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import trainer
from agentgym_jax.models import weights
from environments import jsonl

REPO = pathlib.Path(__file__).resolve().parents[1]


def echo_config(checkpoint_dir: str, advantage: str = "grpo", steps: int = 60):
  """The policy at `checkpoint_dir` on 2-turn echo (config.tiny_echo) with a fixed cap of 2."""
  c = config_lib.base_config()
  c.steps = steps
  c.seed = 0
  c.model.name = checkpoint_dir
  config_lib.tiny_echo(c)
  c.env.options.turns = 2
  c.rollout.max_context = 64
  config_lib.fixed_horizon(2)(c)
  c.algorithm.advantage = advantage
  return c


def conversation(*turns):
  """user, assistant, user, ... from the given contents."""
  roles = ("user", "assistant")
  return [{"role": roles[i % 2], "content": content} for i, content in enumerate(turns)]


def jsonl_file(path, records):
  """`path`, with `records` written to it one JSON object a line."""
  jsonl.write(path, records)
  return path


def check_config(c, error: str | None = None):
  """Validates `c`; given `error`, checks instead that validation fails with a ConfigError that
  matches it, and returns that error."""
  if error is None:
    return settings_lib.Settings.from_config(c)
  with pytest.raises(config_lib.ConfigError, match=error) as raised:
    settings_lib.Settings.from_config(c)
  return raised.value


def assert_resumed_run_matches(straight, c, workdir, keys) -> None:
  """Trains `c` in `workdir` for 2 steps, then, resumed from its step-2 checkpoint, to step 4;
  steps 3 and 4 must log `keys` as the uninterrupted run's history `straight` does."""
  c.steps = 2
  trainer.train(c, workdir)
  c.steps = 4
  resumed = trainer.train(c, workdir)
  for a, b in zip(straight[2:], resumed):
    for key in keys:
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)


def assert_same_tensors(expected_dir, got_dir):
  """The safetensors of `got_dir` equal those of `expected_dir`, name by name; returns the
  expected ones."""
  expected, got = weights.SafetensorsReader(expected_dir), weights.SafetensorsReader(got_dir)
  for name in expected:
    np.testing.assert_allclose(expected[name], got[name], rtol=1e-5, atol=1e-6)
  return expected


def launch_train(config: str, *flags: str, devices: int = 2, timeout: float = 600):
  """Runs launch/train.py on configs/`config` with `flags` on `devices` CPU devices, from the
  repository; returns the finished process, checked to have succeeded."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  result = subprocess.run([
      sys.executable,
      str(REPO / "launch" / "train.py"), f"--config={REPO / 'configs' / config}", *flags
  ], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result
