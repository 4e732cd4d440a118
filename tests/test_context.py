"""Context management (rollout.ContextPolicy): a row's context rewritten every k turns, played by
the sampler and read back by the learner window by window.

Error model (tests/tolerances.py). The learner reads a row of several contexts window by window,
each context of a window attending within itself: the same q, k and v over the same keys as the
context alone in a row of its own, so the two differ by summation order only (the rows' lengths
set flash attention's blocks and XLA's dot order): reordered_logprobs(L, K, |logits|), K the
widest sum. The sampler's log-probs differ from the learner's by the same kind of error (a cached
decode sums in another order). A context read as part of the whole row (a key of an earlier
context seen, or a position not restarted) moves log-probs by far more, which the control below
shows. A gradient is a sum over the trained tokens of such chains: reordered_sum(L K tokens)
relative to its norm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny
import tolerances
import toy_env
from agentgym_jax import config as config_lib, learner, rollout, trainer
from agentgym_jax.batch import Batch, context_windows
from agentgym_jax.models import load_model
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool
from rl_helpers import check_config, echo_config

ROWS = 4
HORIZON = 8
# Replies of at most 3 tokens to the guessing game, which never ends before its 5 guesses: every
# episode plays to the turn cap (its replies are never a guess).
GAME = functools.partial(toy_env.ToyEnv, max_guesses=5)
SAMPLING = rollout.TurnSampling(max_new_tokens=3)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
  return load_model(str(tiny.make_checkpoint(tmp_path_factory.mktemp("tiny"))), dtype=jnp.float32)


def play(policy, context: rollout.ContextPolicy, *, max_context: int = 512,
         horizon: int = HORIZON) -> list[rollout.Trajectory]:
  model, tokenizer = policy
  sampler = Sampler(model, cache_slots=max_context, max_batch=ROWS)
  with EnvPool(GAME, ROWS) as pool:
    player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat, SAMPLING,
                            max_context=max_context, context=context)
    trajectories, _ = rollout.collect(player, [(100 + row // 2, row // 2) for row in range(ROWS)],
                                      horizon=horizon, key=jax.random.key(3))
  return trajectories


def conversation(turns: int) -> list[dict[str, str]]:
  messages = [{"role": "user", "content": "task"}]
  for t in range(1, turns + 1):
    messages += [{"role": "assistant", "content": f"a{t}"}, {"role": "user", "content": f"o{t}"}]
  return messages


def contents(messages):
  return [m["content"] for m in messages]


# --- the policies


def test_a_window_keeps_the_first_user_turn_and_the_last_k_turns():
  window = rollout.ContextPolicy("window", turns=2)
  assert contents(window.messages(conversation(5))) == ["task", "a4", "o4", "a5", "o5"]
  assert contents(window.messages(conversation(1))) == ["task", "a1", "o1"]


def test_masking_keeps_every_reply_and_the_last_k_observations():
  masked = rollout.ContextPolicy("mask_observations", turns=1)
  omitted = rollout.OMITTED_OBSERVATION
  assert contents(masked.messages(
      conversation(3))) == ["task", "a1", omitted, "a2", omitted, "a3", "o3"]
  assert masked.messages(conversation(3))[2]["role"] == "user"


def test_a_context_is_rewritten_every_k_turns_from_2k_turns_on():
  assert [t for t in range(1, 13) if rollout.ContextPolicy("window", turns=3).due(t)] == [6, 9, 12]
  assert [t for t in range(1, 5) if rollout.ContextPolicy("window", turns=1).due(t)] == [2, 3, 4]
  assert not any(rollout.ContextPolicy("full", turns=1).due(t) for t in range(1, 9))


def test_context_policies_are_checked():
  with pytest.raises(ValueError, match="summary"):
    rollout.ContextPolicy("summary")
  with pytest.raises(ValueError, match="turns=0"):
    rollout.ContextPolicy("window", turns=0)
  c = config_lib.base_config()
  c.rollout.context = "windowed"
  check_config(c, "rollout.context='windowed' is not one of")
  c = config_lib.base_config()
  c.rollout.context_turns = 0
  check_config(c, "rollout.context_turns=0 must be an integer >= 1")
  c = config_lib.base_config()
  c.rollout.context = "mask_observations"
  c.algorithm.shared_prompts = True
  check_config(c, "Set one of them off")


def test_contexts_are_packed_in_order_into_windows_of_the_longest_context():
  packed = context_windows([[100, 30, 50, 120], [40]], length=512)
  assert packed["context_window"] == 128  # packed_length(120)
  np.testing.assert_array_equal(packed["context_spans"],
                                [[[0, 100], [100, 80], [180, 120]], [[0, 40], [512, 0], [512, 0]]])


# --- playing


@pytest.mark.parametrize("kind", ["window", "mask_observations"])
def test_each_context_is_the_rewritten_conversation_prefilled_anew(policy, kind):
  _, tokenizer = policy
  context = rollout.ContextPolicy(kind, turns=2)
  for t in play(policy, context):
    assert t.num_turns == HORIZON and t.termination == rollout.HORIZON
    # Rewritten after turns 4 and 6; the episode ends at the cap after turn 8.
    assert len(t.rewrites) == 2
    for (start, _), turns in zip(t.rewrites, (4, 6)):
      shown = context.messages(t.messages[:2 * turns + 1])
      prompt = tokenizer.chat.render(shown, add_generation_prompt=True)
      assert t.tokens[start:start + len(prompt)] == prompt
      assert not any(t.loss_mask[start:start + len(prompt)])
      # The reply that follows answers the rewritten context: the turn's observation span.
      assert (start, start + len(prompt)) in t.observation_spans
    assert len(t.context_lengths()) == 3 and sum(t.context_lengths()) == len(t.tokens)


def test_full_ends_at_the_context_limit_where_a_window_plays_on(policy):
  full = play(policy, rollout.ContextPolicy("full"), max_context=160)
  window = play(policy, rollout.ContextPolicy("window", turns=1), max_context=160)
  assert all(t.termination == rollout.CONTEXT and t.num_turns < HORIZON for t in full)
  assert all(t.termination == rollout.HORIZON and t.num_turns == HORIZON for t in window)
  metrics = rollout.context_metrics(window)
  assert metrics["context/peak_tokens"] <= 160
  assert metrics["context/rewrites"] == HORIZON - 2  # After turns 2..7.
  assert metrics["context/tokens_saved"] > 0
  assert rollout.context_metrics(full)["context/rewrites"] == 0


def test_the_learner_reads_each_context_as_the_sampler_held_it(policy):
  model, _ = policy
  graphdef, params = nnx.split(model)
  played = play(policy, rollout.ContextPolicy("window", turns=1))
  with pytest.raises(ValueError, match="contexts=True"):
    rollout.pack(played)
  batch = rollout.pack(played, contexts=True)
  loss = learner.LossConfig(logprob_chunk=32)
  run = jax.jit(learner.token_logprobs, static_argnums=(0, 3))
  got = np.asarray(run(graphdef, params, batch, loss)[0])
  trained = np.asarray(batch.loss_mask[:, 1:]) > 0
  tolerance = tolerances.reordered_logprobs(
      model.config.num_layers, max(model.config.intermediate_size, batch.tokens.shape[1]),
      max(np.abs(got[trained]).max(), 1.0))
  # As packed (a window a context here), and with each row's contexts in one window.
  row_length = batch.tokens.shape[1]
  sizes = [t.context_lengths() for t in played]
  whole_rows = batch.replace(**context_windows(sizes, row_length, minimum=row_length))
  assert np.all((np.asarray(whole_rows.context_spans)[..., 1] > 0).sum(axis=1) == 1)
  in_one_window = np.asarray(run(graphdef, params, whole_rows, loss)[0])
  np.testing.assert_allclose(in_one_window[trained], got[trained], rtol=0, atol=tolerance)
  # Each context alone, as a row of its own.
  spans = [(i, start, n) for i, t in enumerate(played)
           for start, n in zip(np.cumsum([0] + t.context_lengths()[:-1]), t.context_lengths())]
  tokens = np.zeros((len(spans), batch.tokens.shape[1]), np.int32)
  for row, (i, start, n) in enumerate(spans):
    tokens[row, :n] = played[i].tokens[start:start + n]
  zeros = np.zeros(len(spans))
  separate = Batch(tokens=tokens, loss_mask=np.ones_like(tokens, np.float32),
                   sampler_logprobs=np.zeros_like(tokens, np.float32), rewards=zeros,
                   group_ids=zeros.astype(np.int32))
  want = np.asarray(run(graphdef, params, separate, loss)[0])
  for row, (i, start, n) in enumerate(spans):
    mask = trained[i, start:start + n - 1]
    np.testing.assert_allclose(got[i, start:start + n - 1][mask], want[row, :n - 1][mask], rtol=0,
                               atol=tolerance)
  sampler = np.asarray(batch.sampler_logprobs[:, 1:])
  np.testing.assert_allclose(got[trained], sampler[trained], rtol=0, atol=tolerance)
  # Control: the same row read as one sequence sees the earlier contexts.
  whole = np.asarray(
      run(graphdef, params, batch.replace(contexts=None, context_spans=None), loss)[0])
  later = trained & (np.asarray(batch.contexts[:, 1:]) > 0)
  assert np.abs(whole[later] - sampler[later]).max() > 100 * tolerance

  # The gradient of the trained tokens' log-probs: the contexts' rows alone give the same one.
  def gradient(batch, mask):
    objective = lambda p: jnp.sum(learner.token_logprobs(graphdef, p, batch, loss)[0] * mask)
    return jnp.concatenate(
        [g.ravel() for g in jax.tree.leaves(jax.jit(jax.grad(objective))(params))])

  separate_mask = np.zeros_like(want)
  for row, (i, start, n) in enumerate(spans):
    separate_mask[row, :n - 1] = trained[i, start:start + n - 1]
  got, want = gradient(batch, trained), gradient(separate, separate_mask)
  relative = tolerances.reordered_sum(model.config.num_layers * model.config.intermediate_size *
                                      int(trained.sum()))
  assert float(jnp.linalg.norm(got - want)) <= relative * float(jnp.linalg.norm(want))


def test_a_pass_holds_one_context_of_activations_however_many_contexts_a_row_has(policy):
  """The compiled gradient's scratch memory (XLA's temp buffer: the activations the backward
  keeps) stays that of one context as rows hold 2 to 32 contexts of 128 tokens, where the same
  rows read as one sequence grow with their length."""
  model, _ = policy
  graphdef, params = nnx.split(model)
  loss = learner.LossConfig(logprob_chunk=64)

  def scratch(contexts: int, by_context: bool = True) -> int:
    rows, size = 2, 128
    tokens = np.random.default_rng(0).integers(1, 50, (rows, contexts * size)).astype(np.int32)
    ids = np.repeat(np.arange(contexts, dtype=np.int32), size)[None].repeat(rows, 0)
    spans = np.stack([np.arange(contexts) * size, np.full(contexts, size)], 1).astype(np.int32)
    zeros = np.zeros(rows)
    batch = Batch(tokens=tokens, loss_mask=np.ones_like(tokens, np.float32),
                  sampler_logprobs=np.zeros_like(tokens, np.float32), rewards=zeros,
                  group_ids=zeros.astype(np.int32))
    if by_context:
      batch = batch.replace(contexts=ids, context_spans=spans[None].repeat(rows, 0),
                            context_window=size)
    objective = lambda p: jnp.sum(learner.token_logprobs(graphdef, p, batch, loss)[0])
    compiled = jax.jit(jax.grad(objective)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  two = scratch(2)
  assert scratch(32) <= 1.1 * two
  assert scratch(32, by_context=False) > 8 * scratch(2, by_context=False)


# --- training


def test_training_with_a_window_logs_its_contexts_and_keeps_the_sampler_gap(
    tmp_path, single_device):
  c = echo_config(str(tiny.make_checkpoint(tmp_path / "tiny")), steps=2)
  c.env.options.turns = 4
  c.rollout.max_context = 128
  config_lib.fixed_horizon(4)(c)
  c.rollout.context = "window"
  c.rollout.context_turns = 1
  assert c.model.dtype == "float32"
  history = trainer.train(c, tmp_path / "run")
  assert len(history) == 2
  # The tiny model's logits stay below ~7 (tolerances.py); its widest dot here is the row.
  tolerance = tolerances.reordered_logprobs(2, 128, 10.0)
  for metrics in history:
    assert metrics["context/peak_tokens"] <= 128
    assert float(metrics["logprob_gap_max"]) < tolerance
  assert any(m["context/rewrites"] > 0 for m in history)
