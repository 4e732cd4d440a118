"""Clip-Cov and KL-Cov (Cui et al. 2025; verl's policy losses clip_cov and kl_cov): the
covariance they rank tokens by, worked examples by hand, verl's procedure re-derived in NumPy
on fixed random tensors, and a run that draws the same tokens when resumed."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import rl, trainer
from agentgym_jax.rl import losses
from rl_helpers import assert_resumed_run_matches, echo_config

# One row of four trained tokens and a padding token: mean A = 0 and mean log-prob = -2 over the
# trained ones, so cov = A (logp + 2) = (1, -1, -0.5, 0.5).
_A = np.array([[1.0, 1.0, -1.0, -1.0, 5.0]], np.float32)
_LOGP = np.array([[-1.0, -3.0, -1.5, -2.5, 0.0]], np.float32)
_MASK = np.array([[1, 1, 1, 1, 0]], np.float32)
_LOG_RATIO = np.array([[0.2, 0.0, -0.1, 0.1, 0.0]], np.float32)
_OLD = _LOGP - _LOG_RATIO
# The worked examples' float32 error: per-token terms of order 1 (ulp 1.2e-7) from log ratios
# recovered as float32 differences of log-probs of order 1 (error ~1e-7 each), averaged: the
# loss is within a few 1e-7 of the exact value, and 1e-6 bounds it with room.
_ABS = 1e-6


def test_the_covariance_centres_advantage_and_log_prob_over_the_trained_tokens():
  cov = rl.advantage_logprob_covariance(_A, _LOGP, _MASK)
  np.testing.assert_allclose(cov, [[1.0, -1.0, -0.5, 0.5, 0.0]])


def test_first_in_order_takes_the_lowest_priorities_among_the_eligible():
  priority = jnp.array([3.0, 1.0, 2.0, 0.0])
  eligible = jnp.array([True, True, True, False])
  np.testing.assert_array_equal(losses.first_in_order(priority, eligible, 2),
                                [False, True, True, False])
  np.testing.assert_array_equal(losses.first_in_order(priority, eligible, 9), eligible)


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
  loss, metrics = rl.kl_cov_loss(_LOGP, _OLD, _A, _MASK, kl_cov_ratio=0.5, ppo_kl_coef=1.0)
  # floor(0.5 x 4) = 2 tokens, those of cov 1 and 0.5 (0 and 3), add |log rho|; no clip.
  per_token = [-math.exp(0.2) + 0.2, -1.0, math.exp(-0.1), math.exp(0.1) + 0.1]
  assert float(loss) == pytest.approx(sum(per_token) / 4, abs=_ABS)
  assert float(metrics["cov_penalised_fraction"]) == 0.5
  assert float(metrics["abs_kl"]) == pytest.approx(0.4 / 4, abs=_ABS)
  # A ratio of the trained tokens below one token still penalises one: cov 1's.
  loss, _ = rl.kl_cov_loss(_LOGP, _OLD, _A, _MASK, kl_cov_ratio=1e-4, ppo_kl_coef=2.0)
  per_token[0], per_token[3] = -math.exp(0.2) + 0.4, math.exp(0.1)
  assert float(loss) == pytest.approx(sum(per_token) / 4, abs=_ABS)


def test_clip_cov_detaches_unclipped_tokens_of_covariance_within_its_bounds():
  logp = jnp.asarray(_LOGP)

  def loss_of(logprobs):
    return rl.clip_cov_loss(logprobs, _OLD, _A, _MASK, key=jax.random.key(0), clip=rl.Clip(0.2),
                            clip_cov_ratio=0.25, clip_cov_lb=0.4, clip_cov_ub=5.0)

  (loss, metrics), grad = jax.value_and_grad(loss_of, has_aux=True)(logp)
  # Token 0 (cov 1) is clipped by PPO already (rho = e^0.2 > 1.2, A > 0): not a candidate.
  # Token 3 (cov 0.5) is the one candidate in (0.4, 5): its loss and gradient are 0.
  assert float(loss) == pytest.approx((-1.2 - 1.0 + math.exp(-0.1)) / 4, abs=_ABS)
  np.testing.assert_allclose(grad, [[0.0, -0.25, math.exp(-0.1) / 4, 0.0, 0.0]], atol=_ABS)
  assert float(metrics["clip_fraction"]) == 0.25
  assert float(metrics["cov_detached_fraction"]) == 0.25


def test_clip_cov_draws_its_tokens_with_its_key():
  rng = np.random.default_rng(0)
  shape = (4, 64)
  advantages = np.repeat(rng.choice([-2.0, 2.0], (4, 1)), 64, axis=1).astype(np.float32)
  logprobs = rng.normal(-2.0, 1.0, shape).astype(np.float32)
  mask = np.ones(shape, np.float32)
  cov = np.asarray(rl.advantage_logprob_covariance(advantages, logprobs, mask))
  candidates = (cov > 1.0) & (cov < 5.0)
  assert candidates.sum() > 20

  def detached(seed):
    grad = jax.grad(lambda lp: rl.clip_cov_loss(lp, logprobs, advantages, mask, key=jax.random.key(
        seed), clip_cov_ratio=8 / 256)[0])(jnp.asarray(logprobs))
    return np.asarray(grad) == 0

  drawn = [detached(seed) for seed in range(3)]
  for chosen in drawn:
    assert chosen.sum() == 8 and not (chosen & ~candidates).any()
  np.testing.assert_array_equal(detached(0), drawn[0])
  assert not np.array_equal(drawn[0], drawn[1])


def _verl_kl_cov(logp, old, adv, mask, ratio, coef):
  """verl's kl_cov, step by step in NumPy: the covariance over the valid tokens, the top
  max(1, int(n ratio)) of it penalised by coef |logp - old|, token-mean."""
  valid = mask > 0
  a, lp = adv[valid], logp[valid]
  cov = (a - a.mean()) * (lp - lp.mean())
  top = np.argsort(-cov, kind="stable")[:max(1, int(len(cov) * ratio))]
  per_token = -a * np.exp(lp - old[valid])
  per_token[top] += coef * np.abs(lp - old[valid])[top]
  return per_token.sum() / valid.sum()


def _verl_clip_cov(logp, old, adv, mask, ratio, lower, upper, eps):
  """verl's clip_cov in NumPy when its random draw takes every candidate (there are no more
  than max(int(ratio n), 1)): PPO's clipped loss with those tokens' loss zeroed, token-mean."""
  rho = np.exp(logp - old)
  loss1, loss2 = -adv * rho, -adv * np.clip(rho, 1 - eps, 1 + eps)
  valid = mask > 0
  cov = (adv - adv[valid].mean()) * (logp - logp[valid].mean())
  candidates = valid & ~(loss2 > loss1) & (cov > lower) & (cov < upper)
  assert candidates.sum() <= max(int(ratio * valid.sum()), 1)
  per_token = np.where(candidates, 0.0, np.maximum(loss1, loss2))
  return per_token[valid].sum() / valid.sum()


# Float32 log-probs of order 5 and ratios near 1: terms of order 1 each, summed over ~100 tokens
# with unit roundoff 6e-8, and exp's rounding of a few ulp, put the f32 loss within ~1e-5 relative
# of the float64 NumPy one.
_REL = 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_both_losses_match_verls_procedure_on_fixed_tensors(seed):
  rng = np.random.default_rng(seed)
  shape = (6, 24)
  logp = rng.normal(-2.0, 1.5, shape).astype(np.float32)
  old = (logp - rng.normal(0.0, 0.15, shape)).astype(np.float32)
  adv = np.repeat(rng.normal(0.0, 1.0, (6, 1)), 24, axis=1).astype(np.float32)
  mask = (rng.random(shape) < 0.8).astype(np.float32)
  f64 = lambda *xs: [x.astype(np.float64) for x in xs]
  for ratio, coef in ((0.05, 1.0), (0.2, 0.5)):
    loss, _ = rl.kl_cov_loss(logp, old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    expected = _verl_kl_cov(*f64(logp, old, adv, mask), ratio, coef)
    assert float(loss) == pytest.approx(expected, rel=_REL)
  cov = np.asarray(rl.advantage_logprob_covariance(adv, logp, mask))
  # Bounds that leave at most int(0.1 n) candidates, so verl's draw takes them all: the lower
  # one halfway between two covariances, away from either's rounding.
  ranked = np.sort(cov[mask > 0])
  upper, most = ranked[-1] + 1.0, max(int(0.1 * mask.sum()) // 2, 1)
  lower = (ranked[-most] + ranked[-most - 1]) / 2
  loss, metrics = rl.clip_cov_loss(logp, old, adv, mask, key=jax.random.key(seed),
                                   clip=rl.Clip(0.2), clip_cov_ratio=0.1, clip_cov_lb=float(lower),
                                   clip_cov_ub=float(upper))
  expected = _verl_clip_cov(*f64(logp, old, adv, mask), 0.1, lower, upper, 0.2)
  assert float(loss) == pytest.approx(expected, rel=_REL)
  assert float(metrics["cov_detached_fraction"]) > 0


def test_bad_options_are_refused():
  with pytest.raises(ValueError, match="clip_cov_lb < clip_cov_ub"):
    rl.clip_cov_loss(_LOGP, _OLD, _A, _MASK, key=jax.random.key(0), clip_cov_lb=2.0,
                     clip_cov_ub=1.0)
  with pytest.raises(ValueError, match="Clip-Cov has no dual clip"):
    rl.clip_cov_loss(_LOGP, _OLD, _A, _MASK, key=jax.random.key(0), clip=rl.Clip(0.2, dual_c=3.0))
  with pytest.raises(ValueError, match="kl_cov_ratio > 0"):
    rl.kl_cov_loss(_LOGP, _OLD, _A, _MASK, kl_cov_ratio=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss", ["clip_cov", "kl_cov"])
def test_a_resumed_run_of_each_loss_matches_an_uninterrupted_one(policy_loss, checkpoint_dir,
                                                                 tmp_path, single_device):
  # Ratios high enough that the tiny batches act on several tokens; Clip-Cov's bounds wide
  # enough to find candidates. Resumed at step 2, Clip-Cov draws the tokens it drew straight.
  c = echo_config(checkpoint_dir, steps=4)
  c.algorithm.policy_loss = policy_loss
  c.algorithm.clip_cov_ratio = c.algorithm.kl_cov_ratio = 0.1
  c.algorithm.clip_cov_lb = -10.0
  c.checkpoint.every = 2
  straight = trainer.train(c, tmp_path / "straight")
  acted = {"clip_cov": "policy/cov_detached_fraction", "kl_cov": "policy/cov_penalised_fraction"}
  assert all(row[acted[policy_loss]] > 0 for row in straight)
  assert_resumed_run_matches(straight, c, tmp_path / "resumed",
                             ("reward", "loss", "grad_norm", acted[policy_loss]))
