"""The RL train loop end to end: learning on a toy task, horizon caps, exact resume, launch."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import tiny
from agentgym_jax import config as config_lib
from agentgym_jax import metrics, trainer

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
  return str(tiny.make_checkpoint(tmp_path_factory.mktemp("tiny")))


def echo_config(checkpoint_dir: str, advantage: str = "grpo", steps: int = 40):
  c = config_lib.base_config()
  c.steps = steps
  c.seed = 0
  c.model.name = checkpoint_dir
  c.model.dtype = "float32"
  c.model.remat = "none"
  c.mesh.fsdp = 1
  c.mesh.data = 1
  c.env.name = "echo"
  c.env.options.turns = 2
  c.rollout.tasks_per_step = 8
  c.rollout.samples_per_task = 8
  c.rollout.max_new_tokens = 2
  c.rollout.max_context = 64
  c.horizon.kind = "fixed"
  c.horizon.turns = 2
  c.algorithm.advantage = advantage
  c.algorithm.kl_coef = 0.0
  c.algorithm.entropy_coef = 0.0
  c.algorithm.num_minibatches = 2
  c.algorithm.ppo_epochs = 2
  c.algorithm.logprob_chunk = 64
  c.optim.learning_rate = 3e-3
  c.optim.weight_decay = 0.0
  c.checkpoint.every = 0
  c.checkpoint.export_hf = False
  c.log.tensorboard = False
  c.log.trajectories = False
  c.log.progress_bar = False
  return c


def _single_device(monkeypatch):
  # The learning tests run on one device; sharding is tested elsewhere.
  import jax
  from agentgym_jax import sharding

  monkeypatch.setattr(sharding, "make_mesh", lambda *a, **k: sharding.Mesh(
      np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES))


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_plus_plus", "gae"])
def test_tiny_policy_learns_echo(advantage, checkpoint_dir, tmp_path, monkeypatch):
  _single_device(monkeypatch)
  c = echo_config(checkpoint_dir, advantage)
  if advantage == "gae":
    c.algorithm.value_coef = 1.0
  history = trainer.train(c, tmp_path)
  success = [h["success"] for h in history]
  # A random policy answers both turns right a few percent of the time.
  assert np.mean(success[:3]) < 0.3
  assert max(np.mean(success[i:i + 3]) for i in range(len(success) - 2)) >= 0.9, success
