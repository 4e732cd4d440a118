"""Bounded-staleness asynchronous RL (rollout.max_staleness, agentgym_jax/rollout_queue.py): step s
is played by the policy of max(0, s - k) updates, ahead of the learner, and corrected in the loss
by the sampler's log-probs; a run is a function of its seed whatever the timing, and resumes
exactly. Partial rollouts (rollout.partial_rollouts) move a step's live episodes to newer
policies at fixed decode calls, each token sampled from the policy its turn records."""

import threading
import time

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny
import tolerances
import toy_env
from agentgym_jax import hooks, learner, rollout, rollout_queue, settings, trainer
from agentgym_jax.models import load_model
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool
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


def test_published_policies_are_waited_for_and_the_newest_k_plus_1_kept():
  got = []
  with rollout_queue.RolloutQueue(lambda step, params, version: None, 2) as queue:
    queue.publish(0, "v0")
    reader = threading.Thread(target=lambda: got.append(queue.policy(1)))
    reader.start()
    time.sleep(0.05)
    assert got == [] and reader.is_alive()  # Version 1 is not made yet.
    queue.publish(1, "v1")
    reader.join(5)
    assert got == ["v1"]
    queue.publish(2, "v2")
    queue.publish(3, "v3")
    assert [queue.policy(v) for v in (1, 2, 3)] == ["v1", "v2", "v3"]
    with pytest.raises(RuntimeError, match="version 0 is not available.*not kept"):
      queue.policy(0)
    waiting = []

    def wait_for_version_9():
      try:
        queue.policy(9)
      except RuntimeError as error:
        waiting.append(str(error))

    reader = threading.Thread(target=wait_for_version_9)
    reader.start()
  reader.join(5)  # Closing the queue releases a rollout waiting for a policy never made.
  assert "the run stopped" in waiting[0]


def test_partial_rollouts_switch_at_fixed_decode_calls_up_to_the_steps_own_version():
  fetched = []
  switches = rollout.PolicySwitches(3, 5, 2, lambda v: fetched.append(v) or f"p{v}")
  assert [switches.next_call() for _ in range(7)] == [(3, "p3"), (3, "p3"), (4, "p4"), (4, "p4"),
                                                      (5, "p5"), (5, "p5"), (5, "p5")]
  assert fetched == [3, 4, 5]  # Each version fetched once, when first used.
  with pytest.raises(ValueError, match="every 0"):
    rollout.PolicySwitches(3, 5, 0, str)


def test_each_turn_of_a_partial_rollout_is_sampled_from_the_policy_it_records(tmp_path):
  """Six guessing-game episodes on four rows (refilled as they end), moving from version 0 to
  version 3 every 2 decode calls: every reply's sampler log-probs are those of its recorded
  version's policy, read by the learner over the whole episode (so the rows re-prefilled at a
  switch hold exactly the new policy's keys and values), and not those of the first policy."""
  model, tokenizer = load_model(str(tiny.make_checkpoint(tmp_path)), dtype=jnp.float32)
  graphdef, params = nnx.split(model)
  versions = {0: params}
  for v in (1, 2, 3):
    noise = jax.random.split(jax.random.key(v), len(jax.tree.leaves(params)))
    versions[v] = jax.tree.unflatten(jax.tree.structure(params), [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(jax.tree.leaves(params), noise)
    ])
  sampler = Sampler(model, cache_slots=256, max_batch=2)
  with EnvPool(functools.partial(toy_env.ToyEnv, max_guesses=5), 4) as pool:
    player = rollout.Player(sampler, versions[0], pool, tokenizer.chat,
                            rollout.TurnSampling(max_new_tokens=3), max_context=256, groups=2,
                            switches=rollout.PolicySwitches(0, 3, 2, versions.get))
    played, _ = rollout.collect(player, [(100 + i // 2, i // 2) for i in range(6)], horizon=5,
                                key=jax.random.key(1), rows=4)
  turn_versions = [v for t in played for v in t.turn_versions]
  assert set(turn_versions) == {0, 1, 2, 3}
  assert all(t.num_turns == len(t.turn_versions) == 5 for t in played)
  batch = rollout.pack(played)
  loss = learner.LossConfig(logprob_chunk=32)
  run = jax.jit(learner.token_logprobs, static_argnums=(0, 3))
  by_version = {v: np.asarray(run(graphdef, p, batch, loss)[0]) for v, p in versions.items()}
  # Each target token's version: that of the turn whose reply it is.
  version_of = np.full(batch.tokens.shape, -1)
  for row, t in enumerate(played):
    turn = np.cumsum(np.diff(np.asarray(t.loss_mask), prepend=0) == 1) - 1
    version_of[row, :len(t.tokens)] = np.where(
        np.asarray(t.loss_mask) > 0,
        np.asarray(t.turn_versions)[turn], -1)
  version_of = version_of[:, 1:]
  sampler_logprobs = np.asarray(batch.sampler_logprobs[:, 1:])
  scale = max(max(np.abs(lp[version_of >= 0]).max() for lp in by_version.values()), 1.0)
  tolerance = tolerances.reordered_logprobs(model.config.num_layers,
                                            max(model.config.intermediate_size, 256), scale)
  for v, logprobs in by_version.items():
    sampled = version_of == v
    np.testing.assert_allclose(sampler_logprobs[sampled], logprobs[sampled], rtol=0, atol=tolerance,
                               err_msg=f"version {v}")
  later = version_of > 0
  assert np.abs(sampler_logprobs[later] - by_version[0][later]).max() > 100 * tolerance


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


def test_the_correction_defaults_to_decoupled_ppo_when_asynchronous(checkpoint_dir):
  # algorithm.rollout_correction = auto (the default): none in step, decoupled when stale.
  c = _config(checkpoint_dir, 0)
  c.algorithm.rollout_correction = "auto"
  assert check_config(c).update.loss.rollout_correction == "none"
  c.rollout.max_staleness = 1
  assert check_config(c).update.loss.rollout_correction == "decoupled"
  c.algorithm.rollout_correction = "token_tis"
  assert check_config(c).update.loss.rollout_correction == "token_tis"
  c.algorithm.rollout_correction = "sometimes"
  check_config(c, r"algorithm.rollout_correction='sometimes' is not one of \['auto', 'none'")


def test_partial_rollouts_are_checked(checkpoint_dir):
  c = _config(checkpoint_dir, 0)
  c.rollout.partial_rollouts = 2
  check_config(c, "rollout.partial_rollouts=2 moves a stale rollout.*max_staleness > 0")
  c.rollout.partial_rollouts = -1
  check_config(c, "rollout.partial_rollouts=-1 must be an integer >= 0")


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


def _killed_after_step_3_and_resumed(c, workdir, monkeypatch):
  """The metrics of `c` run in `workdir` (checkpointing every 2 steps), killed after step 3
  and resumed."""
  step_end = hooks.StepHooks.step_end

  def killed_after_step_3(self, step, *args, **kwargs):
    step_end(self, step, *args, **kwargs)
    if step == 3:
      raise KeyboardInterrupt

  with monkeypatch.context() as patch:
    patch.setattr(hooks.StepHooks, "step_end", killed_after_step_3)
    with pytest.raises(KeyboardInterrupt):
      trainer.train(c, workdir)
  return trainer.train(c, workdir)


@pytest.mark.parametrize("stale", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_an_async_run_killed_and_resumed_matches_an_uninterrupted_one(checkpoint_dir, tmp_path,
                                                                      stale, monkeypatch,
                                                                      single_device):
  c = _config(checkpoint_dir, stale, steps=5)
  c.checkpoint.every = 2
  straight = trainer.train(c, tmp_path / "straight")
  # Killed after step 3, past the checkpoint of step 2, whose buffer holds the rollouts of
  # steps 3 .. 2 + k played ahead by the policies of their versions.
  resumed = _killed_after_step_3_and_resumed(c, tmp_path / "resumed", monkeypatch)
  assert [row["step"] for row in resumed] == [3, 4, 5]
  for a, b in zip(straight[2:], resumed):
    for key in ("reward", "loss", "grad_norm", "mismatch/kl", "rollout/staleness"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_a_partial_rollout_run_moves_to_newer_policies_and_resumes_exactly(
    checkpoint_dir, tmp_path, monkeypatch, single_device):
  # Echo's two turns are two decode calls a step: with k = 2 and a switch every call, step s
  # plays its first turn with version s - 2 and its second with s - 1, up to the checkpoint
  # after 2 updates: the rollouts of steps 2 .. 4 are saved there, so they use no later policy
  # (step 4 none after its first).
  c = _config(checkpoint_dir, 2, steps=5)
  c.rollout.partial_rollouts = 1
  c.checkpoint.every = 2
  c.log.trajectories = True
  straight = trainer.train(c, tmp_path / "straight")
  assert [row["rollout/staleness"] for row in straight] == [0, 1, 2, 2, 2]
  second_turns = {1: [0, 1], 2: [0, 1], 3: [1, 2], 4: [2, 2]}  # By step, an episode's versions.
  for step, row in enumerate(straight):
    records = [
        json.loads(line) for line in (tmp_path / "straight" / "trajectories" /
                                      f"step_{step + 1:06d}.jsonl").read_text().splitlines()
    ]
    versions = [r.get("turn_versions", [r["policy_version"]] * r["num_turns"]) for r in records]
    assert row["rollout/turn_staleness"] == pytest.approx(step - np.mean(sum(versions, [])))
    if step:
      assert {tuple(v) for v in versions if len(v) == 2} == {tuple(second_turns[step])}
  resumed = _killed_after_step_3_and_resumed(c, tmp_path / "resumed", monkeypatch)
  for a, b in zip(straight[2:], resumed):
    for key in ("reward", "loss", "grad_norm", "mismatch/kl", "rollout/turn_staleness"):
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
