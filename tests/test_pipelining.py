"""Pipelined rollouts (`rollout.collect` by a Player of G groups): the same episodes as one
group, env steps of one group issued while another group's decode is in flight, env faults still
per episode; rollouts in waves (`rollout.collect_waves`) or on refilled rows (continuous
batching): the same episodes as all rows at once."""

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import faulty_env
import tiny
import tolerances
from agentgym_jax import config as config_lib, evaluation, rollout, trainer
from agentgym_jax import settings as settings_lib
from agentgym_jax.models import load_model
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool
from rl_helpers import check_config, echo_config

ROWS = 16
ECHO = functools.partial(faulty_env.FaultyEchoEnv, turns=4, num_train=8)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
  return load_model(str(tiny.make_checkpoint(tmp_path_factory.mktemp("tiny"))), dtype=jnp.float32)


def play(policy, env, groups, tasks, *, horizon=4, step_timeout_s=60.0, sampler=None):
  model, tokenizer = policy
  sampler = sampler or Sampler(model, cache_slots=96, max_batch=len(tasks) // groups)
  with EnvPool(env, len(tasks), step_timeout_s=step_timeout_s) as pool:
    player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                            rollout.TurnSampling(max_new_tokens=3), max_context=96, groups=groups)
    return rollout.collect(player, tasks, horizon=horizon, key=jax.random.key(7), first_row=5)


def echo_tasks():
  return [(100 + row // 2, row // 2) for row in range(ROWS)]  # 8 tasks x 2 samples.


def assert_same_episodes(expected, played):
  """Episode by episode the same tokens, rewards, ends and messages, and the same sampler
  log-probs up to the reordering error model (batches or groups of other sizes block the
  sampler's sums otherwise)."""
  for a, b in zip(expected, played):
    assert (b.tokens, b.loss_mask, b.turn_rewards, b.termination,
            b.messages) == (a.tokens, a.loss_mask, a.turn_rewards, a.termination, a.messages)
    atol = tolerances.reordered_logprobs(2, 128, max(np.abs(a.sampler_logprobs).max(), 1.0))
    np.testing.assert_allclose(b.sampler_logprobs, a.sampler_logprobs, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, 4])
def test_pipelined_rollout_plays_the_same_episodes_as_one_group(policy, groups, monkeypatch):
  generate, checked = Sampler.generate, []

  def checked_generate(self, state, key, **kwargs):
    # The lengths collect keeps on the host are the ones the cache holds.
    np.testing.assert_array_equal(kwargs["lengths"], np.asarray(state.lengths))
    checked.append(kwargs["lengths"])
    return generate(self, state, key, **kwargs)

  monkeypatch.setattr(Sampler, "generate", checked_generate)
  expected, _ = play(policy, ECHO, 1, echo_tasks())
  played, stats = play(policy, ECHO, groups, echo_tasks())
  # A random policy: some episodes end at the first wrong answer, others go on (the groups'
  # live rows differ turn by turn).
  assert min(t.num_turns for t in expected) == 1 and max(t.num_turns for t in expected) >= 2
  assert_same_episodes(expected, played)
  assert stats.generated_tokens == sum(sum(t.loss_mask) for t in played)
  assert len(checked) > 1 + groups  # Later turns were checked too.
  assert stats.generate_s > 0 and stats.env_s > 0
  assert 0 <= stats.env_hidden_s <= min(stats.env_s, stats.generate_s)


def test_groups_step_their_envs_while_another_group_decodes(policy, monkeypatch):
  events = []
  generate, step_async = Sampler.generate, EnvPool.step_async

  def logged_generate(self, state, key, **kwargs):
    events.append(("decode", kwargs["rows"]))
    return generate(self, state, key, **kwargs)

  def logged_step_async(self, requests):
    events.append(("env", [slot for slot, _ in requests]))
    return step_async(self, requests)

  monkeypatch.setattr(Sampler, "generate", logged_generate)
  monkeypatch.setattr(EnvPool, "step_async", logged_step_async)
  play(policy, ECHO, 2, echo_tasks(), horizon=2)
  # Turn 0: both groups' decodes are dispatched before either group's env steps, and group 0's
  # envs are stepped (slots 0-7) before group 1's tokens are fetched for its own env step.
  assert [kind for kind, _ in events[:4]] == ["decode", "decode", "env", "env"]
  assert events[2][1] == list(range(8)) and events[3][1] == list(range(8, 16))
  # Turn 1: group 0 decodes again (its surviving rows) before group 1's envs are waited on.
  assert events[4][0] == "decode" and max(events[4][1]) < 8


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2])
def test_rollouts_in_waves_play_the_same_episodes_as_all_rows_at_once(policy, groups):
  model, tokenizer = policy
  expected, _ = play(policy, ECHO, 1, echo_tasks())
  wave = 6  # 16 rows: waves of 6, 6 and 4.
  sampler = Sampler(model, cache_slots=96, max_batch=wave // groups)
  with EnvPool(ECHO, wave) as pool:
    player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                            rollout.TurnSampling(max_new_tokens=3), max_context=96, groups=groups)
    played, stats = rollout.collect_waves(player, echo_tasks(), wave_rows=wave, horizon=4,
                                          key=jax.random.key(7), first_row=5)
  assert [(t.task_id, t.group) for t in played] == echo_tasks()
  # Each row draws from its keys in the whole batch.
  assert_same_episodes(expected, played)
  assert stats.generated_tokens == sum(sum(t.loss_mask) for t in played)


@pytest.mark.parametrize("groups", [1, 2])
def test_refilled_rows_play_the_same_episodes_as_all_rows_at_once(policy, groups, monkeypatch):
  # 16 episodes on 6 rows: a row whose episode ends takes the next one at once, its cache row
  # released and the new prompt prefilled beside the other rows' turns.
  generate, lengths_checked = Sampler.generate, []

  def checked_generate(self, state, key, **kwargs):
    np.testing.assert_array_equal(kwargs["lengths"], np.asarray(state.lengths))
    lengths_checked.append(True)
    return generate(self, state, key, **kwargs)

  model, tokenizer = policy
  expected, _ = play(policy, ECHO, 1, echo_tasks())
  monkeypatch.setattr(Sampler, "generate", checked_generate)
  wave = 6
  stats = {}
  for refill, compact in ((False, False), (True, False), (True, True)):
    sampler = Sampler(model, cache_slots=96, max_batch=wave // groups, compact_decode=compact)
    with EnvPool(ECHO, wave) as pool:
      player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                              rollout.TurnSampling(max_new_tokens=3), max_context=96, groups=groups,
                              refill=refill)
      played, stats[refill,
                    compact] = rollout.collect_waves(player, echo_tasks(), wave_rows=wave,
                                                     horizon=4, key=jax.random.key(7), first_row=5)
    assert [(t.task_id, t.group) for t in played] == echo_tasks()
    assert_same_episodes(expected, played)
  waves, refilled, compacted = stats[False, False], stats[True, False], stats[True, True]
  assert refilled.generated_tokens == waves.generated_tokens == compacted.generated_tokens
  # Waves keep finished rows in every decode until their wave's longest episode ends; refilled
  # rows are busy until the queue runs dry.
  assert refilled.decode_row_steps < waves.decode_row_steps
  assert refilled.idle_row_fraction < waves.idle_row_fraction
  # Which is rows holding no episode: in waves every row whose episode ended, refilled only
  # once the queue is empty. Whole replies never decode beside a row stepping its env.
  assert refilled.no_episode_row_steps < waves.no_episode_row_steps
  assert refilled.stepping_row_steps == waves.stepping_row_steps == 0
  # The tail's decodes of a few rows compute on those rows (Sampler.decode_rows).
  assert compacted.no_episode_row_steps < refilled.no_episode_row_steps
  assert compacted.idle_row_fraction < refilled.idle_row_fraction
  assert lengths_checked


def play_in_chunks(policy, chunk, groups, *, hang_s=0.0, compact_decode=True):
  """16 echo episodes of replies of up to 5 tokens on 6 refilled rows, `chunk` tokens a decode
  call (0: whole replies); task 100's first env step takes `hang_s` seconds; the sampler with
  `compact_decode` as given."""
  model, tokenizer = policy
  env = functools.partial(faulty_env.FaultyEchoEnv, turns=4, num_train=8, hang_tasks=(0,),
                          hang_s=hang_s)
  sampler = Sampler(model, cache_slots=96, max_batch=6 // groups, compact_decode=compact_decode)
  with EnvPool(env, 6) as pool:
    player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                            rollout.TurnSampling(max_new_tokens=5), max_context=96, groups=groups,
                            refill=True, decode_chunk=chunk)
    return rollout.collect_waves(player, echo_tasks(), wave_rows=6, horizon=4,
                                 key=jax.random.key(7), first_row=5)


@pytest.mark.parametrize("groups", [1, 2])
def test_replies_decoded_in_chunks_play_the_same_episodes_as_whole_replies(
    policy, groups, monkeypatch):
  # 2 tokens a call; task 100's slow first steps hold back only their rows, so rows start
  # replies beside rows in the middle of theirs: each token still draws from its own key.
  generate, offsets = Sampler.generate, []

  def checked_generate(self, state, key, **kwargs):
    np.testing.assert_array_equal(kwargs["lengths"], np.asarray(state.lengths))
    offsets.append(set(kwargs["offsets"][kwargs["rows"]].tolist()))
    return generate(self, state, key, **kwargs)

  monkeypatch.setattr(Sampler, "generate", checked_generate)
  whole, whole_stats = play_in_chunks(policy, 0, groups)
  # Whole replies: a call starts replies together, or finishes together, on fewer rows, the
  # last replies of the call before it once half of that call's rows were done (shrink).
  assert all(len(calls) == 1 for calls in offsets)
  assert {0} in offsets and any(calls != {0} for calls in offsets)
  offsets.clear()
  compacted, compacted_stats = play_in_chunks(policy, 2, groups, hang_s=0.3)
  assert_same_episodes(whole, compacted)
  assert compacted_stats.generated_tokens == whole_stats.generated_tokens
  # Without compact decodes, rows whose slow env step is in flight sit out decode calls in
  # them: idle row-steps of their own (with, they mostly leave the call).
  chunked, chunked_stats = play_in_chunks(policy, 2, groups, hang_s=0.3, compact_decode=False)
  assert_same_episodes(whole, chunked)
  assert chunked_stats.generated_tokens == whole_stats.generated_tokens
  # (Whole replies: only as the idle row that pads the call finishing a round's last reply to
  # the smallest program, 2 rows.)
  assert chunked_stats.stepping_row_steps > whole_stats.stepping_row_steps
  parts = chunked_stats.idle_parts()
  assert sum(parts.values()) == pytest.approx(chunked_stats.idle_row_fraction)
  assert parts["env_step"] > 0 and parts["reply_ended"] >= 0
  assert any(len(calls) > 1 for calls in offsets)  # Rows at different points of their replies.


def test_whole_replies_make_the_same_decode_calls_whatever_the_env_timing(policy, monkeypatch):
  # Calls that shrink finish a round's last replies while its first rows step their envs, but
  # the round's rows start their next replies together: task 100's slow first steps change
  # no call (partial rollouts count them).
  generate, calls = Sampler.generate, []

  def recorded_generate(self, state, key, **kwargs):
    calls[-1].append((kwargs["rows"], kwargs["offsets"].tolist(), kwargs["budgets"].tolist()))
    return generate(self, state, key, **kwargs)

  monkeypatch.setattr(Sampler, "generate", recorded_generate)
  played = []
  for hang_s in (0.0, 0.4):
    calls.append([])
    played.append(play_in_chunks(policy, 0, 1, hang_s=hang_s)[0])
  assert calls[0] == calls[1]
  assert any(offsets != [0] * len(offsets) for _, offsets, _ in calls[0])  # Calls shrank.
  assert_same_episodes(*played)


def test_rows_decode_while_another_row_of_their_group_steps_its_env(policy, monkeypatch):
  # One group; each step of task 100 waits until a row starts a reply, for at most `wait_s`.
  # With whole replies none does: the group waits for those rows before it starts replies
  # again (calls finishing the last replies of a round may run meanwhile). In chunks its
  # other rows start their next replies meanwhile, however long the calls take to compile.
  generate, step = Sampler.generate, faulty_env.FaultyEchoEnv.step
  started = threading.Condition()
  replies = [0]  # Calls that started a reply so far.
  waited = []  # Per step of task 100: whether a reply started while it ran.

  def counted_generate(self, state, key, **kwargs):
    if (kwargs["offsets"][kwargs["rows"]] == 0).any():
      with started:
        replies[0] += 1
        started.notify_all()
    return generate(self, state, key, **kwargs)

  def waiting_step(self, action_text):
    if self._task_id == 100:
      with started:
        before = replies[0]
        waited.append(started.wait_for(lambda: replies[0] > before, timeout=wait_s))
    return step(self, action_text)

  monkeypatch.setattr(Sampler, "generate", counted_generate)
  monkeypatch.setattr(faulty_env.FaultyEchoEnv, "step", waiting_step)
  during = {}
  for chunk, wait_s in ((0, 0.5), (2, 60.0)):
    waited.clear()
    play_in_chunks(policy, chunk, 1)
    assert waited
    during[chunk] = any(waited)
  assert not during[0] and during[2]


def test_the_decode_chunk_is_checked_and_reaches_the_player(policy):
  c = echo_config("unused")
  c.rollout.decode_chunk = 8
  settings = check_config(c)
  model, tokenizer = policy
  sampler = Sampler(model, cache_slots=64, max_batch=2)
  with EnvPool(ECHO, 2) as pool:
    player = settings.rollout.player(sampler, sampler.params, pool, tokenizer.chat)
  assert player.decode_chunk == 8
  assert player.chunk() == min(8, c.rollout.max_new_tokens)
  assert dataclasses.replace(player, decode_chunk=0).chunk() == c.rollout.max_new_tokens
  with pytest.raises(ValueError, match="partial rollouts switch policies"):
    dataclasses.replace(player, switches=rollout.PolicySwitches(0, 1, 1, lambda v: None))
  c.rollout.decode_chunk = -1
  check_config(c, r"rollout.decode_chunk=-1 must be an integer >= 0 \(0: a whole reply\)")
  c.rollout.decode_chunk = 8
  c.rollout.max_staleness = 1
  c.algorithm.rollout_correction = "decoupled"
  c.rollout.partial_rollouts = 2
  check_config(
      c, "rollout.partial_rollouts=2 switches policies .* rollout.decode_chunk=8 "
      "depends on when env steps come back")


def test_a_refilled_evaluation_scores_what_batch_by_batch_does_when_greedy(policy):
  # Greedy turns draw nothing, so the keys (batch by batch, or one per episode of the whole)
  # do not matter: both evaluations play the same episodes, 16 on 6 rows.
  model, tokenizer = policy
  runs = {}
  for refill in (False, True):
    sampler = Sampler(model, cache_slots=96, max_batch=6)
    reports = []
    with EnvPool(ECHO, 6) as pool:
      player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                              rollout.TurnSampling(max_new_tokens=3, temperature=0.0),
                              max_context=96, refill=refill)
      summary, played = evaluation.evaluate(player, list(range(100, 108)), samples_per_task=2,
                                            horizon=4, key=jax.random.key(7), rows_per_batch=6,
                                            progress=lambda done, total: reports.append(done))
    runs[refill] = (summary, played, reports)
  assert runs[True][0] == runs[False][0]
  assert_same_episodes(runs[False][1], runs[True][1])
  # Batch by batch the progress comes after each batch; refilled, as episodes end.
  assert runs[False][2] == [6, 12, 16]
  assert runs[True][2] == sorted(runs[True][2]) and runs[True][2][-1] == 16
  assert len(runs[True][2]) > 3


def test_rollout_stats_of_waves_add_up():
  total = rollout.RolloutStats.total([
      rollout.RolloutStats(generate_s=1.0, env_s=2.0, env_hidden_s=0.5, generated_tokens=10,
                           decode_row_steps=16),
      rollout.RolloutStats(generate_s=0.25, env_s=1.0, env_hidden_s=0.0, generated_tokens=3,
                           decode_row_steps=4)
  ])
  assert total == rollout.RolloutStats(1.25, 3.0, 0.5, 13, 20)
  assert total.env_hidden_fraction == 0.5 / 3.0
  assert total.idle_row_fraction == 1 - 13 / 20
  parts = rollout.RolloutStats(generated_tokens=10, decode_row_steps=16, no_episode_row_steps=2,
                               stepping_row_steps=3).idle_parts()
  assert parts == pytest.approx({"no_episode": 2 / 16, "env_step": 3 / 16, "reply_ended": 1 / 16})


def test_env_faults_end_only_their_episode_under_pipelining(policy):
  # Tasks 100..103 x 2 samples; group 0 plays tasks 100-101, group 1 tasks 102-103.
  faulty = functools.partial(faulty_env.FaultyEchoEnv, turns=2, num_train=4, raise_tasks=(1,),
                             hang_tasks=(2,), hang_s=3.0)
  tasks = [(100 + row // 2, row // 2) for row in range(8)]
  played, _ = play(policy, faulty, 2, tasks, horizon=2, step_timeout_s=1.0)
  terminations = {
      task_id: {t.termination for t in played if t.task_id == task_id}
      for task_id in range(100, 104)
  }
  assert terminations[101] == {rollout.ENV_ERROR}
  assert terminations[102] == {rollout.ENV_TIMEOUT}
  for task_id in (100, 103):
    assert terminations[task_id] <= {rollout.DONE, rollout.HORIZON}, terminations
  for t in played:
    assert t.num_turns >= 1 and sum(t.loss_mask) >= 1
    assert len(t.tokens) == len(t.loss_mask) == len(t.sampler_logprobs)


def test_groups_must_fit_the_sampler_rows(policy):
  model, _ = policy
  sampler = Sampler(model, cache_slots=96, max_batch=4)
  echo = functools.partial(faulty_env.FaultyEchoEnv, turns=2, num_train=8)
  with pytest.raises(ValueError, match="need 16 env slots and 8 sampler rows"):
    play(policy, echo, 2, echo_tasks(), sampler=sampler)


def test_the_configured_sampler_has_a_group_of_rows_and_the_cache_dtype(policy):
  model, _ = policy
  c = config_lib.base_config()
  c.rollout.max_context = 96
  c.rollout.max_new_tokens = 32
  c.rollout.pipeline_groups = 2
  c.rollout.cache_dtype = "bfloat16"
  sampler = settings_lib.Settings.from_config(c).rollout.sampler(model, None, 16)
  assert (sampler.max_batch, sampler.cache_slots) == (8, 96)
  # The cache holds 16-bit values as raw bits: half the bytes of the f32 model's default.
  assert sampler.cache_dtype == jnp.bfloat16 and sampler.empty().cache.k[0].dtype.itemsize == 2
  c.rollout.cache_dtype = ""
  default = settings_lib.Settings.from_config(c).rollout.sampler(model, None, 16)
  assert default.cache_dtype == jnp.float32 and default.empty().cache.k[0].dtype.itemsize == 4


@pytest.mark.slow
def test_training_with_two_groups_matches_one_group(tmp_path, single_device):
  c = echo_config(str(tiny.make_checkpoint(tmp_path / "tiny")), steps=2)
  c.eval.every = 2
  c.eval.max_tasks = 6  # 6 eval episodes in batches of the step's 64 rows: groups of 3.
  one = trainer.train(c, tmp_path / "one")
  c.rollout.pipeline_groups = 2
  two = trainer.train(c, tmp_path / "two")
  for a, b in zip(one, two):
    for key in ("reward", "turns", "tokens_generated", "loss", "grad_norm", "eval/success"):
      if key in a:
        # The same episodes; the step's means differ by reordering alone (the sampler's
        # log-probs enter through the logged gap), relative to their size.
        np.testing.assert_allclose(b[key], a[key], rtol=tolerances.reordered_sum(1024), atol=1e-6,
                                   err_msg=key)
    assert 0 <= b["rollout/env_hidden_fraction"] <= 1
  assert "eval/success" in two[-1]


@pytest.mark.slow
def test_training_in_waves_matches_all_rows_at_once(tmp_path, single_device):
  c = echo_config(str(tiny.make_checkpoint(tmp_path / "tiny")), steps=2)
  whole = trainer.train(c, tmp_path / "whole")
  c.rollout.wave_rows = 16  # 64 rows a step in 4 waves.
  assert settings_lib.Settings.from_config(c).rollout.wave(64) == 16
  waves = trainer.train(c, tmp_path / "waves")
  for a, b in zip(whole, waves):
    for key in ("reward", "turns", "tokens_generated", "loss", "grad_norm"):
      np.testing.assert_allclose(b[key], a[key], rtol=tolerances.reordered_sum(1024), atol=1e-6,
                                 err_msg=key)
  c.rollout.pipeline_groups = 2
  c.rollout.wave_rows = 15
  check_config(c, "wave_rows=15 must be 0")


def test_hidden_env_time_is_the_overlap_of_busy_intervals():
  # Device busy [0, 2] and [1, 3] -> [0, 3]; env busy [2.5, 4] and [3.5, 5] -> [2.5, 5].
  device = rollout._union([(1.0, 3.0), (0.0, 2.0)])
  env = rollout._union([(3.5, 5.0), (2.5, 4.0)])
  assert device == [(0.0, 3.0)] and env == [(2.5, 5.0)]
  # Both busy during [2.5, 3]: 0.5 s of the 2.5 s of env time were hidden.
  assert rollout._length(rollout._intersection(device, env)) == 0.5
  assert rollout._length(rollout._intersection([(0.0, 1.0), (2.0, 3.0)], [(0.5, 2.5)])) == 1.0
  assert rollout.RolloutStats(env_s=2.5, env_hidden_s=0.5).env_hidden_fraction == 0.2
  assert rollout.RolloutStats().env_hidden_fraction == 0.0
