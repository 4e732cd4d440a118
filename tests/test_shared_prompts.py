"""Shared prompts: the samples of a group packed as one row (the prompt once, then each
continuation) give the log-probs, entropies, values and gradients of the unshared rows.

Error model (tests/tolerances.py). The packed forward pass computes every token's hidden state
from the same q, k and v over the same visible keys at the same positions as its own row does;
only the rows' lengths differ, and with them the blocks in which flash attention visits the keys
and the order in which XLA sums the dots. So the two differ by summation order alone: logits by
reordered_logits(L, K, |logits|) with K the widest sum (the MLP width, or the keys a query sees),
log-probs by twice that. A gradient entry sums those per-token terms over the batch's tokens, in
another order again: reordered_sum(L * K * tokens) of the largest entry. A defect (a sibling's key
seen, a position off by one, a target of another sample) moves log-probs by 1e-2 or more.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import config as config_lib, learner, rollout
from agentgym_jax import settings as settings_lib
from agentgym_jax.batch import Batch, share_prompts
from agentgym_jax.models import attention
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder

import tolerances
from rl_helpers import check_config

CONFIG = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4,
                     attention_bias=True, tie_word_embeddings=True)
LENGTH = 48  # Row length of the unshared layout.
PROMPT = 14  # Tokens before the first reply.


@pytest.fixture(scope="module")
def policy():
  # Small flash tiles, so that the packed rows span several blocks and diagonals.
  model = Decoder(CONFIG, attention="flash", rngs=nnx.Rngs(0))
  return nnx.split(model)


@pytest.fixture(autouse=True)
def small_flash_blocks(monkeypatch):
  monkeypatch.setattr(attention, "FLASH_BLOCK", 32)


def _tolerance(logits_scale: float = 4.0) -> float:
  return tolerances.reordered_logprobs(CONFIG.num_layers, max(CONFIG.intermediate_size, 6 * LENGTH),
                                       logits_scale)


# --- the attention mask


def _shared_mask(segments: np.ndarray) -> np.ndarray:
  """The mask written out pair by pair: query t sees key s <= t of its own segment or of the
  prompt (segment 0)."""
  batch, length = segments.shape
  mask = np.zeros((batch, length, length), bool)
  for b in range(batch):
    for t in range(length):
      for s in range(t + 1):
        mask[b, t, s] = segments[b, s] == segments[b, t] or segments[b, s] == 0
  return mask


def _packed_segments() -> np.ndarray:
  """Two packed rows of 150: a prompt of 37 and continuations of 1, 50 and 40 tokens, then
  padding; a prompt of 3 and one continuation of 120; then padding."""
  first = np.concatenate(
      [np.zeros(37), np.ones(1),
       np.full(50, 2), np.full(40, 3),
       np.full(22, -1)])
  second = np.concatenate([np.zeros(3), np.ones(120), np.full(27, -1)])
  return np.stack([first, second]).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("implementation, block", [("flash", 32), ("flash", 64), ("dense", None),
                                                   ("splash", None)])
def test_shared_prompt_attention_matches_the_dense_masked_reference(implementation, block):
  segments = _packed_segments()
  batch, length = segments.shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = 2.0 * jax.random.uniform(keys[0], (batch, length, 6, 16), jnp.float32, -1.0, 1.0)
  k = 2.0 * jax.random.uniform(keys[1], (batch, length, 2, 16), jnp.float32, -1.0, 1.0)
  v = jax.random.uniform(keys[2], (batch, length, 2, 16), jnp.float32, -1.0, 1.0)
  real = segments >= 0
  cotangent = jax.random.uniform(keys[3], q.shape, jnp.float32, -1.0, 1.0) * real[:, :, None, None]
  mask = jnp.asarray(_shared_mask(segments))

  def reference(q, k, v):
    out = attention.dense_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask,
                                    jnp.float32)
    return jnp.sum(out * cotangent), out

  def shared(q, k, v):
    out = attention.causal_attention(q, k, v, jnp.asarray(segments), implementation=implementation,
                                     block=block, shared_prompt=True)
    return jnp.sum(out * cotangent), out

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  (_, out), grads = grad(shared)
  (_, ref_out), ref_grads = grad(reference)
  # A query sees at most 150 keys (attention's error model in tests/test_attention.py).
  relative = tolerances.reordered_sum(length)
  tolerances.assert_attention_close(out, ref_out, grads, ref_grads, real=real, v=v,
                                    relative=relative)
  # The mask matters: continuations that saw their siblings would move outputs by ~1/50.
  sibling_blind = attention.causal_attention(q, k, v, jnp.asarray(segments), implementation="dense")
  assert float(jnp.max(jnp.abs(sibling_blind - ref_out)[real])) > 1e-2


def test_a_shared_prompt_needs_segment_ids():
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match="segment ids"):
    attention.causal_attention(q, q, q, None, shared_prompt=True)


# --- the packed layout


def test_share_prompts_packs_a_worked_example():
  # Group 7: rows 0 and 2 share the prompt [5, 6, 7] (replies start at 3); row 2 also shares the
  # first reply token, which stays out of the prompt. Group 3: row 1 alone, row 3 empty.
  tokens = np.array([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 2, 3], [0] * 6])
  shared = share_prompts(tokens, np.array([5, 4, 6, 0]), np.array([3, 2, 3, 0]), [7, 3, 7, 3],
                         length=12, rows_multiple=4)
  # Shared prompt: the common prefix before the first reply, [5, 6, 7], less its last token,
  # which starts each continuation at position 2.
  for field, rows in {
      "tokens": [[5, 6, 7, 8, 9, 7, 8, 2, 3, 0, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0]],
      "segments": [[0, 0, 1, 1, 1, 2, 2, 2, 2, -1, -1, -1], [0, 1, 1, 1] + [-1] * 8],
      "positions": [[0, 1, 2, 3, 4, 2, 3, 4, 5, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0]],
      "targets": [[6, 7, 8, 9, 0, 8, 2, 3, 0, 0, 0, 0], [2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0]],
  }.items():
    np.testing.assert_array_equal(getattr(shared, field)[:2], rows, err_msg=field)
  # Padded to 4 packed rows with empty ones.
  assert shared.tokens.shape == (4, 12) and (shared.segments[2:] == -1).all()
  np.testing.assert_array_equal(shared.rows, [0, 1, 0, 1])
  np.testing.assert_array_equal(
      shared.index, [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 5, 6, 7], [0, 0, 0, 0, 0]])


def _trajectory(rng, group: int, prompt: np.ndarray, turns: list[tuple[int, int]]):
  """A rollout record: `prompt`, then per turn a reply of r generated tokens and (but after the
  last) an observation of o tokens."""
  t = rollout.Trajectory(task_id=group, group=group)
  t.observe(prompt.tolist())
  for k, (reply, observation) in enumerate(turns):
    t.extend(
        rng.integers(1, CONFIG.vocab_size, reply).tolist(), trained=True,
        logprobs=rng.normal(-2.0, 0.3, reply).tolist())
    t.turn_rewards.append(float(rng.integers(0, 2)))
    if k + 1 < len(turns):
      t.observe(rng.integers(1, CONFIG.vocab_size, observation).tolist())
  return t


def _trajectories(seed: int = 0) -> list[rollout.Trajectory]:
  """Ragged multi-turn groups: 3 samples of task 0 (replies and observations of other lengths,
  one sample ending after a turn of 1 token), 2 of task 1 whose prompts differ in the last two
  tokens, 1 of task 2, and a sample of task 1 that failed at reset (no tokens)."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, CONFIG.vocab_size, PROMPT) for _ in range(3)]
  other = prompts[1].copy()
  other[-2:] = (other[-2:] % (CONFIG.vocab_size - 1)) + 1
  failed = rollout.Trajectory(task_id=1, group=1, termination=rollout.ENV_ERROR)
  return [
      _trajectory(rng, 0, prompts[0], [(5, 3), (7, 4), (4, 0)]),
      _trajectory(rng, 0, prompts[0], [(1, 0)]),
      _trajectory(rng, 0, prompts[0], [(9, 6), (3, 0)]),
      _trajectory(rng, 1, prompts[1], [(6, 2), (8, 0)]), failed,
      _trajectory(rng, 1, other, [(12, 0)]),
      _trajectory(rng, 2, prompts[2], [(4, 5), (2, 3), (6, 0)])
  ]


def _batches(trajectories, **options):
  unshared = rollout.pack(trajectories, length=LENGTH, **options)
  shared = rollout.pack(trajectories, length=LENGTH, shared_prompts=True, **options)
  return unshared, shared


def _valid(batch: Batch) -> np.ndarray:
  """The target positions of the real tokens: input t < the row's length."""
  lengths = (np.asarray(batch.tokens) != 0).sum(-1)
  return np.arange(LENGTH - 1)[None] < lengths[:, None]


def test_packed_rows_hold_each_rows_inputs_targets_and_positions():
  unshared, shared = _batches(_trajectories())
  layout = shared.shared
  inputs, targets, _ = unshared.inputs_and_targets()
  valid = _valid(unshared)
  positions = np.broadcast_to(np.arange(LENGTH - 1), valid.shape)
  for packed, want in ((layout.tokens, inputs), (layout.targets, targets), (layout.positions,
                                                                            positions)):
    np.testing.assert_array_equal(np.asarray(layout.unpack(packed))[valid], np.asarray(want)[valid])
  # Each group's prompt is in its packed row once: 3 packed rows for 7 samples, fewer tokens.
  assert layout.tokens.shape[0] == 3
  assert (layout.segments >= 0).sum() < valid.sum()


def test_logprobs_entropies_and_values_equal_the_unshared_rows(policy):
  graphdef, params = policy
  unshared, shared = _batches(_trajectories())
  head = learner.ValueHead(CONFIG.hidden_size)
  head.kernel.value = jax.random.normal(jax.random.key(1), (CONFIG.hidden_size,))
  loss = learner.LossConfig(logprob_chunk=16)
  run = jax.jit(learner.token_logprobs, static_argnums=(0, 3))
  expected = run(graphdef, params, unshared, loss, head)
  got = run(graphdef, params, shared, loss, head)
  valid = _valid(unshared)
  for name, x, want in zip(("logprobs", "entropies", "values"), got, expected):
    np.testing.assert_allclose(
        np.asarray(x)[valid],
        np.asarray(want)[valid], rtol=0, atol=_tolerance(), err_msg=name)


gradients = jax.jit(learner._gradients, static_argnums=4)


def _assert_gradients_close(got, want, unshared: Batch, context: str = "") -> None:
  """Entry by entry within a reordered sum over the unshared batch's tokens (the module's error
  model) of the largest entry of `want`."""
  tokens = int(_valid(unshared).sum())
  relative = tolerances.reordered_sum(CONFIG.num_layers * 6 * LENGTH * tokens)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=0, atol=relative * scale,
                               err_msg=context + jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("changes", [
    dict(aggregation="token-mean", rollout_correction="sequence_mask"),
    dict(aggregation="seq-mean-token-sum-norm", policy_loss="cispo", loss_scale_tokens=30.0),
    dict(advantage_estimator="gae", value_coef=0.5, aggregation="seq-mean-token-mean")
])
def test_gradients_equal_the_unshared_rows_with_excluded_rows(policy, changes):
  graphdef, params = policy
  trajectories = _trajectories(seed=1)
  unshared, shared = _batches(trajectories)
  # Dynamic sampling's filler rows: sample 2's loss mask is zeroed after packing.
  trained = np.ones((len(trajectories), 1), np.float32)
  trained[2] = 0.0
  unshared, shared = (b.replace(loss_mask=b.loss_mask * trained) for b in (unshared, shared))
  loss = learner.LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1, entropy_coef=0.01,
                            logprob_chunk=16, **changes)
  value_graphdef = value_params = None
  if loss.uses_critic:
    head = learner.ValueHead(CONFIG.hidden_size)
    head.kernel.value = 0.1 * jax.random.normal(jax.random.key(2), (CONFIG.hidden_size,))
    value_graphdef, value_params = nnx.split(head)
  networks = learner.Networks(graphdef, value_graphdef)
  experience, _ = learner.compute_experience(networks, (params, value_params), params, unshared,
                                             loss=loss, num_groups=2 * len(trajectories))
  # The rollout correction drops sample 5 from every term of the loss.
  experience = experience.replace(kept=experience.kept.at[5].set(0.0))
  # A policy one step away from the one that played, so ratios and the KL are not trivial.
  params = jax.tree.map(lambda p: p * 1.01, params)
  want, want_metrics = gradients((params, value_params), networks, unshared, experience, loss)
  got, metrics = gradients((params, value_params), networks, shared, experience, loss)
  _assert_gradients_close(got, want, unshared)
  for key in metrics:
    np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=1e-4, atol=_tolerance(),
                               err_msg=key)


def test_experience_equals_the_unshared_rows(policy):
  graphdef, params = policy
  unshared, shared = _batches(_trajectories(seed=2))
  loss = learner.LossConfig(kl_coef=0.1, rollout_correction="token_tis", logprob_chunk=16)
  run = lambda b: learner.compute_experience(learner.Networks(graphdef), (params, None), params, b,
                                             loss=loss, num_groups=14, num_turns=3)
  (want, want_metrics), (got, metrics) = run(unshared), run(shared)
  mask = np.asarray(unshared.loss_mask[:, 1:]) > 0
  for field in dataclasses.fields(want):
    x, w = np.asarray(getattr(got, field.name)), np.asarray(getattr(want, field.name))
    if x.ndim == 2:
      x, w = x[mask], w[mask]
    np.testing.assert_allclose(x, w, rtol=0, atol=_tolerance(), err_msg=field.name)
  for key in metrics:
    np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=1e-4, atol=_tolerance(),
                               err_msg=key)


# --- minibatches and micro-batches of whole groups


def _uniform_trajectories() -> list[rollout.Trajectory]:
  """4 tasks x 2 samples, ragged continuations, one sample of task 2 failed at reset."""
  rng = np.random.default_rng(3)
  out = []
  for group in range(4):
    prompt = rng.integers(1, CONFIG.vocab_size, PROMPT)
    for sample in range(2):
      if (group, sample) == (2, 1):
        out.append(rollout.Trajectory(task_id=group, group=group, termination=rollout.ENV_ERROR))
        continue
      turns = [(int(rng.integers(1, 8)), int(rng.integers(1, 5))) for _ in range(1 + sample)]
      out.append(_trajectory(rng, group, prompt, turns))
  return out


def test_minibatches_take_whole_groups_padded_to_the_devices():
  row_groups = np.repeat(np.arange(4), 2)
  order = learner.minibatch_indices(8, 2, 2, np.random.default_rng(0), row_groups)
  assert len(order) == 4
  for epoch in (order[:2], order[2:]):
    assert sorted(np.concatenate(epoch).tolist()) == list(range(8))
  for rows in order:  # Two whole groups, group by group.
    assert rows.tolist() in (
        [2 * g, 2 * g + 1, 2 * h, 2 * h + 1] for g in range(4) for h in range(4) if g != h)
  with pytest.raises(ValueError, match="4 groups do not split into 3 minibatches"):
    learner.minibatch_indices(8, 3, 1, np.random.default_rng(0), row_groups)
  _, shared = _batches(_uniform_trajectories())
  taken = learner.take_batch(shared, np.array([6, 7, 2, 3]), row_groups, rows_multiple=4)
  # Packed rows 3 and 1, then two empty ones; the samples read rows 0 and 1 of them.
  assert taken.shared.tokens.shape == (4, shared.shared.tokens.shape[1])
  np.testing.assert_array_equal(taken.shared.tokens[:2], shared.shared.tokens[np.array([3, 1])])
  assert (np.asarray(taken.shared.segments[2:]) == -1).all()
  np.testing.assert_array_equal(taken.shared.rows, [0, 0, 1, 1])
  np.testing.assert_array_equal(taken.tokens, shared.tokens[np.array([6, 7, 2, 3])])


@pytest.mark.slow
def test_a_minibatch_of_groups_and_its_micro_batches_give_the_unshared_gradient(policy):
  graphdef, params = policy
  unshared, shared = _batches(_uniform_trajectories())
  row_groups = np.asarray(shared.shared.rows)
  loss = learner.LossConfig(kl_coef=0.1, entropy_coef=0.01, logprob_chunk=16,
                            aggregation="seq-mean-token-mean")
  networks = learner.Networks(graphdef)
  experience, _ = learner.compute_experience(networks, (params, None), params, unshared, loss=loss,
                                             num_groups=16)
  # The experience pass in micro-batches of 2 groups (4 samples) reads the samples back in order.
  micro = dataclasses.replace(loss, micro_batch_rows=4)
  parted, _ = learner.compute_experience(networks, (params, None), params, shared, loss=micro,
                                         num_groups=16)
  mask = np.asarray(unshared.loss_mask[:, 1:]) > 0
  np.testing.assert_allclose(
      np.asarray(parted.old_logprobs)[mask],
      np.asarray(experience.old_logprobs)[mask], rtol=0, atol=_tolerance())
  params = jax.tree.map(lambda p: p * 1.01, params)
  (rows,) = learner.minibatch_indices(8, 1, 1, np.random.default_rng(1), row_groups)
  rows = rows[::-1].copy()  # Any order of whole groups.
  want, _ = gradients((params, None), networks, learner.take_rows(unshared, rows),
                      learner.take_rows(experience, rows), loss)
  minibatch = learner.take_batch(shared, rows, row_groups, rows_multiple=2)
  for micro_batch_rows in (0, 4, 2):  # One pass; 2 micro-batches of 2 groups; 4 of 1.
    got, _ = gradients((params, None), networks, minibatch, learner.take_rows(experience, rows),
                       dataclasses.replace(loss, micro_batch_rows=micro_batch_rows))
    _assert_gradients_close(got, want, unshared, f"micro_batch_rows={micro_batch_rows} ")


@pytest.mark.parametrize("changes, message", [
    (dict(num_minibatches=4), r"num_minibatches=4 does not divide the 6 tasks per step"),
    (dict(micro_batch_rows=2), r"micro_batch_rows=2 is not a multiple of "
     r"rollout.samples_per_task=4"),
])
def test_layouts_that_split_a_task_fail_at_start_up(changes, message):
  c = config_lib.base_config()
  c.rollout.tasks_per_step, c.rollout.samples_per_task = 6, 4  # 24 rows: 4 minibatches of 6.
  c.algorithm.num_minibatches = 2
  c.algorithm.shared_prompts = True
  c.algorithm.update(changes)
  check_config(c, message)
  c.algorithm.shared_prompts = False  # Row by row, each of these splits is fine.
  settings_lib.Settings.from_config(c)
