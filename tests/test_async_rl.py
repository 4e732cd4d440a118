"""Bounded-staleness asynchronous RL (rollout.max_staleness, agentgym_jax/rollout_queue.py): step s
is played by the policy of max(0, s - k) updates, ahead of the learner, and corrected in the loss
by the sampler's log-probs; a run is a function of its seed whatever the timing, and resumes
exactly."""

import threading
import time

import numpy as np
import pytest

import tolerances
from agentgym_jax import hooks, rollout_queue, settings, trainer
from rl_helpers import check_config, echo_config

# Metrics that measure time, or the staleness itself, and differ between otherwise equal runs.
TIMING = ("time/", "tokens_per_s", "rollout/staleness", "rollout/env_hidden_fraction")


def _config(checkpoint_dir, stale: int, steps: int = 4, learning_rate: float | None = None):
  c = echo_config(checkpoint_dir, steps=steps)
  c.rollout.max_staleness = stale
  c.algorithm.rollout_correction = "decoupled"
  if learning_rate is not None:
    c.optim.learning_rate = learning_rate
  return c


# --- the queue


def test_the_queue_plays_ahead_on_its_own_thread_in_order():
  played, gate = [], threading.Event()

  def play(step, params, version):
    gate.wait(5)
    played.append((step, params, version, threading.current_thread().name))
    return step * 10

  with rollout_queue.RolloutQueue(play, 2, snapshot=lambda p: p + "'") as queue:
    for step in range(3):
      queue.submit(step, "p0", 0)
    assert played == []  # Nothing played until released: the caller did not wait.
    gate.set()
    assert queue.take(0) == 0
    assert queue.played() == {1: 10, 2: 20}  # Waited for, and kept.
    queue.submit(3, "p1", 1)
    assert queue.run(lambda: len(played)) == 4  # After everything queued before it.
    assert [queue.take(step) for step in (1, 2, 3)] == [10, 20, 30]
  assert [p[:3] for p in played] == [(0, "p0'", 0), (1, "p0'", 0), (2, "p0'", 0), (3, "p1'", 1)]
  assert all(p[3].startswith("rollout-queue") for p in played)


def test_a_synchronous_queue_plays_each_step_when_taken_in_the_callers_thread():
  calls = []
  queue = rollout_queue.RolloutQueue(
      lambda step, params, version: calls.append((step, params, version, threading.get_ident())), 0)
  queue.submit(0, "p0", 0)
  assert calls == []
  queue.take(0)
  assert calls == [(0, "p0", 0, threading.get_ident())]
  assert queue.played() == {}
  assert queue.run(lambda: "here") == "here"


def test_an_error_on_the_rollout_side_reaches_the_learner():

  def play(step, params, version):
    time.sleep(0.01)
    raise RuntimeError(f"step {step} failed")

  with rollout_queue.RolloutQueue(play, 1) as queue:
    queue.submit(0, None, 0)
    with pytest.raises(RuntimeError, match="step 0 failed"):
      queue.take(0)


# --- configs


def test_staleness_is_checked(checkpoint_dir):
  c = _config(checkpoint_dir, -1)
  check_config(c, "rollout.max_staleness=-1 must be an integer >= 0")
  c = _config(checkpoint_dir, 2)
  c.algorithm.rollout_correction = "none"
  check_config(c, "set algorithm.rollout_correction")
  for correction in ("decoupled", "token_tis", "geometric_mask"):
    c.algorithm.rollout_correction = correction
    check_config(c)


# --- training


def test_without_updates_an_async_run_is_the_synchronous_run(checkpoint_dir, tmp_path,
                                                             single_device):
  # With a learning rate of 1e-30 an update moves no parameter of f32 magnitude above 1e-22
  # (AdamW's step is about the learning rate) and leaves every logit's f32 rounding as it was:
  # every policy version plays as the first, so playing ahead changes nothing but the timing
  # and the runs log the same metrics, bit for bit (each step draws its own keys).
  tiny_step = 1e-30
  sync = trainer.train(_config(checkpoint_dir, 0, steps=3, learning_rate=tiny_step),
                       tmp_path / "sync")
  stale = trainer.train(_config(checkpoint_dir, 2, steps=3, learning_rate=tiny_step),
                        tmp_path / "stale")
  assert [row["rollout/staleness"] for row in stale] == [0, 1, 2]
  for a, b in zip(sync, stale):
    assert a.keys() - {"rollout/staleness"} == b.keys() - {"rollout/staleness"}
    for key in a:
      if key != "time" and not key.startswith(TIMING):
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=0, err_msg=key)


def test_stale_rollouts_are_played_by_the_older_policy_and_corrected(checkpoint_dir, tmp_path,
                                                                     single_device):
  sync = trainer.train(_config(checkpoint_dir, 0, steps=3), tmp_path / "sync")
  stale = trainer.train(_config(checkpoint_dir, 1, steps=3), tmp_path / "stale")
  assert [row["rollout/staleness"] for row in stale] == [0, 1, 1]
  # Step 1 plays the same episodes as the synchronous step 1 only if the policy had not moved:
  # here it plays the initial policy's, which the synchronous step 0 played with its own keys.
  assert stale[0]["reward"] == sync[0]["reward"] and stale[0]["loss"] == sync[0]["loss"]
  # The sampler's log-probs are those of the policy one update back: the mismatch the
  # correction weighs is that update's, far above the rounding of a fresh rollout.
  fresh = tolerances.reordered_logprobs(2, 128, 10.0)**2
  assert sync[1]["mismatch/kl"] < fresh
  assert stale[1]["mismatch/kl"] > 100 * fresh
  assert stale[1]["rollout_correction/weight_mean"] != 1.0


@pytest.mark.parametrize("stale", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_an_async_run_killed_and_resumed_matches_an_uninterrupted_one(checkpoint_dir, tmp_path,
                                                                      stale, monkeypatch,
                                                                      single_device):
  c = _config(checkpoint_dir, stale, steps=5)
  c.checkpoint.every = 2
  straight = trainer.train(c, tmp_path / "straight")
  # Killed after step 3, past the checkpoint of step 2, whose buffer holds the rollouts of
  # steps 3 .. 2 + k played ahead by the policies of their versions.
  step_end = hooks.StepHooks.step_end

  def killed_after_step_3(self, step, *args, **kwargs):
    step_end(self, step, *args, **kwargs)
    if step == 3:
      raise KeyboardInterrupt

  with monkeypatch.context() as patch:
    patch.setattr(hooks.StepHooks, "step_end", killed_after_step_3)
    with pytest.raises(KeyboardInterrupt):
      trainer.train(c, tmp_path / "resumed")
  resumed = trainer.train(c, tmp_path / "resumed")
  assert [row["step"] for row in resumed] == [3, 4, 5]
  for a, b in zip(straight[2:], resumed):
    for key in ("reward", "loss", "grad_norm", "mismatch/kl", "rollout/staleness"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_the_log_prob_gap_stops_a_step_played_by_the_policy_it_trains_only():
  health = settings.Health(max_consecutive_nonfinite=5, max_logprob_gap=1.0)
  for on_policy in ({"logprob_gap_mean": 1.5}, {"logprob_gap_mean": 1.5, "rollout/staleness": 0}):
    with pytest.raises(RuntimeError, match="no longer on-policy"):
      health.check(on_policy)
  health.check({"logprob_gap_mean": 1.5, "rollout/staleness": 1})  # The updates since: no defect.
  health.check({"logprob_gap_mean": 0.5})


# --- learning


def _updates_to_learn(history) -> int:
  """The first step whose success, averaged over it and the next two, reaches 0.9 (the echo
  learning test's bar); one past the run if none does."""
  success = [row["success"] for row in history]
  return next(
      (step + 1 for step in range(len(success) - 2) if np.mean(success[step:step + 3]) >= 0.9),
      len(success) + 1)


@pytest.mark.slow
def test_async_runs_learn_echo_in_as_many_updates_as_the_synchronous_one(
    checkpoint_dir, tmp_path, single_device):
  """Staleness 1 and 2 reach the synchronous run's success in its number of updates, +20%, over
  3 seeds (about ten minutes)."""
  updates = {}
  for stale in (0, 1, 2):
    for seed in (0, 1, 2):
      c = _config(checkpoint_dir, stale, steps=60)
      c.seed = seed
      updates[stale, seed] = _updates_to_learn(trainer.train(c, tmp_path / f"k{stale}_s{seed}"))
  mean = {stale: np.mean([updates[stale, seed] for seed in range(3)]) for stale in (0, 1, 2)}
  print("updates to learn echo, by staleness and seed:", updates, "means:", mean)
  assert mean[0] <= 60, updates
  for stale in (1, 2):
    assert mean[stale] <= 1.2 * mean[0], updates
