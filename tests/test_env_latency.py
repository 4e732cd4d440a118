"""Slow environment steps on purpose (environments/latency.py, env.latency): log-normal sleeps of
the configured mean, capped, drawn from (seed, episode, task, turn) alone."""

import functools
import math

import numpy as np
import pytest

import toy_env
from agentgym_jax import config as config_lib
from environments import latency as latency_lib
from environments.latency import StepLatency
from environments.pool import EnvPool
from rl_helpers import check_config


def test_the_draws_have_the_configured_mean_and_cap_and_repeat():
  # 20,000 draws of a log-normal of mean 0.3 and sigma 0.9 (no cap in reach): the sample mean's
  # standard error is 0.3 sqrt(exp(0.81) - 1) / sqrt(20,000) = 0.0022; 5 of them bound it.
  wide = StepLatency(0.3, 0.9, max_s=1e9)
  draws = np.array(
      [wide.seconds(episode, 7, turn) for episode in range(2000) for turn in range(10)])
  standard_error = 0.3 * math.sqrt(math.expm1(0.81)) / math.sqrt(draws.size)
  assert abs(draws.mean() - 0.3) < 5 * standard_error
  assert np.all(draws > 0)
  capped = StepLatency(0.3, 0.9, max_s=3.0)
  tail = [capped.seconds(episode, 7, 0) for episode in range(20000)]
  assert max(tail) == 3.0  # The 99.9th percentile is near 3 s: some of 20,000 reach the cap.
  assert capped.seconds(4, 7, 2) == capped.seconds(4, 7, 2) != capped.seconds(4, 7, 3)
  assert StepLatency(0.3, seed=1).seconds(4, 7, 2) != capped.seconds(4, 7, 2)
  with pytest.raises(ValueError, match="needs mean > 0"):
    StepLatency(0.5, max_s=0.1)


def test_a_slowed_pool_sleeps_each_step_its_draw_and_plays_the_same_game(monkeypatch):
  slept = []
  monkeypatch.setattr(latency_lib.time, "sleep", slept.append)
  latency = StepLatency(0.3)
  game = functools.partial(toy_env.ToyEnv, max_guesses=3)
  with EnvPool(game, 2) as plain, EnvPool(game, 2, latency=latency) as slow:
    assert slow.env_name == plain.env_name == "toy"
    assert slow.instruction == plain.instruction
    for pool in (plain, slow):
      pool.reset([(0, 100), (1, 101)])
    for turn in range(2):
      requests = [(0, "Action: guess 1"), (1, "Action: guess 9")]
      assert slow.step(requests) == plain.step(requests)
  # Each slot plays its adapter's first episode (0), of task 100 and 101: turns 0 and 1 sleep
  # their draws (the toy game's own sleeps are of 0 s).
  assert sorted(s for s in slept if s > 0) == sorted(
      latency.seconds(0, task, turn) for task in (100, 101) for turn in range(2))


def test_the_config_builds_a_slowed_pool():
  c = config_lib.base_config()
  c.env.latency.mean_s = 0.3
  settings = check_config(c)
  assert settings.env.latency == StepLatency(0.3, 0.9, 3.0, c.seed)
  assert check_config(config_lib.base_config()).env.latency is None
  c.env.latency.max_s = 0.1
  check_config(c, "max_s >= mean_s")
