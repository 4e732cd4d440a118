"""Micro-batches: the experience and the minibatch gradient of one pass, accumulated in parts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import config as config_lib, learner, rl
from agentgym_jax.batch import Batch
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder

import tolerances
from rl_helpers import check_config

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     tie_word_embeddings=True)
ROWS, LENGTH = 8, 24
gradients = jax.jit(learner._gradients, static_argnums=4)


@pytest.fixture(scope="module")
def policy():
  return nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(0)))


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CONFIG.vocab_size, (ROWS, LENGTH)).astype(np.int32)
  loss_mask = np.zeros((ROWS, LENGTH), np.float32)
  for row in range(ROWS):
    start, stop = sorted(rng.choice(np.arange(2, LENGTH + 1), 2, replace=False))
    loss_mask[row, start:stop] = 1.0  # Ragged replies of 1 to 21 tokens...
  loss_mask[5] = 0.0  # ...and an excluded (failed) episode with none.
  return Batch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(loss_mask),
               sampler_logprobs=jnp.asarray(rng.normal(-2.0, 0.3, (ROWS, LENGTH)), jnp.float32),
               rewards=jnp.asarray(rng.integers(0, 2, ROWS), jnp.float32),
               group_ids=jnp.asarray(np.repeat(np.arange(ROWS // 4), 4), jnp.int32))


def _config(**changes):
  return learner.LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1, entropy_coef=0.01,
                            logprob_chunk=8, **changes)


def _grad_tolerance(grads) -> float:
  """Each gradient entry sums the same per-token terms, grouped per micro-batch first: a
  reordered sum over the batch's tokens (tests/tolerances.py), relative to the largest entry,
  through the decoder's L layers of dots."""
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
  return tolerances.reordered_sum(
      ROWS * LENGTH * CONFIG.num_layers * CONFIG.intermediate_size) * scale


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch_rows, changes", [
    (1, dict(aggregation="token-mean")),
    (4, dict(aggregation="token-mean", rollout_correction="token_tis")),
    (2, dict(aggregation="seq-mean-token-mean", policy_loss="gspo")),
    (4, dict(aggregation="seq-mean-token-sum-norm", policy_loss="cispo")),
])
def test_accumulated_gradients_equal_the_whole_minibatch(policy, micro_batch_rows, changes):
  graphdef, params = policy
  batch = _batch()
  whole = _config(**changes)
  networks = learner.Networks(graphdef)
  experience, _ = learner.compute_experience(networks, (params, None), params, batch, loss=whole,
                                             num_groups=ROWS // 4)
  # A trajectory the rollout correction dropped counts in no unit of the loss.
  experience = experience.replace(kept=jnp.asarray([1, 1, 0, 1, 1, 1, 1, 0], jnp.float32))
  # A policy one step away from the one that played, so ratios and the KL are not trivial.
  params = jax.tree.map(lambda p: p * 1.01, params)
  expected, expected_metrics = gradients((params, None), networks, batch, experience, whole)
  parts = dataclasses.replace(whole, micro_batch_rows=micro_batch_rows)
  grads, metrics = gradients((params, None), networks, batch, experience, parts)
  tolerance = _grad_tolerance(expected)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)
  assert metrics.keys() == expected_metrics.keys()
  for key in metrics:
    np.testing.assert_allclose(metrics[key], expected_metrics[key], err_msg=key,
                               rtol=tolerances.reordered_sum(ROWS * LENGTH), atol=1e-6)


def test_the_experience_pass_in_micro_batches_equals_one_pass(policy):
  graphdef, params = policy
  batch = _batch(seed=1)
  whole = _config()
  networks = learner.Networks(graphdef)
  expected, expected_metrics = learner.compute_experience(networks, (params, None), params, batch,
                                                          loss=whole, num_groups=ROWS // 4)
  got, metrics = learner.compute_experience(networks, (params, None), params, batch,
                                            loss=dataclasses.replace(whole, micro_batch_rows=2),
                                            num_groups=ROWS // 4)
  # Each row's forward pass is the same computation on fewer rows: the reordering model of
  # tests/tolerances.py for log-probs of logits of order 1.
  tolerance = tolerances.reordered_logprobs(CONFIG.num_layers, CONFIG.intermediate_size, 4.0)
  for name in ("old_logprobs", "ref_logprobs", "advantages", "returns"):
    np.testing.assert_allclose(getattr(got, name), getattr(expected, name), rtol=0, atol=tolerance,
                               err_msg=name)
  for key in metrics:
    np.testing.assert_allclose(metrics[key], expected_metrics[key], rtol=0, atol=tolerance,
                               err_msg=key)


def test_micro_batches_take_interleaved_rows_and_join_back():
  rows = jnp.arange(8)
  parts = learner.micro_batches(rows, 2)
  # 4 micro-batches of 2 rows: rows j and j + 4.
  assert parts.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert learner.join_micro_batches(parts).tolist() == list(range(8))


def test_units_are_trained_tokens_or_rows_holding_them():
  mask = jnp.asarray([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], jnp.float32)
  assert float(rl.aggregation_units(mask, "token-mean")) == 6.0
  assert float(rl.aggregation_units(mask, "seq-mean-token-mean")) == 2.0
  assert float(rl.aggregation_units(mask, "seq-mean-token-sum")) == 2.0
  assert float(rl.aggregation_units(mask, "seq-mean-token-sum-norm")) == 2.0


@pytest.mark.parametrize("rows, message", [
    (3, r"algorithm.micro_batch_rows=3 must be 0 \(off\) or divide the minibatch of 8"),
    (-1, r"algorithm.micro_batch_rows=-1 must be 0 \(off\)"),
])
def test_micro_batch_rows_that_do_not_divide_a_minibatch_fail_at_start_up(rows, message):
  c = config_lib.base_config()
  c.rollout.tasks_per_step, c.rollout.samples_per_task = 4, 4
  c.algorithm.num_minibatches = 2
  c.algorithm.micro_batch_rows = rows
  check_config(c, message)
