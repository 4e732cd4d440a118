"""Losses and per-token log-probs: worked values, clipping bounds, and chunked-vs-full parity."""

import math

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.rl import losses
import tolerances

# Exercised under jit throughout: proves static shapes and keeps the file fast.
aggregate = jax.jit(losses.aggregate, static_argnames=("aggregation",))
policy_gradient_loss = jax.jit(losses.policy_gradient_loss, static_argnames=("clip", "aggregation"))
kl_divergence = jax.jit(losses.kl_divergence, static_argnames=("estimator",))
value_loss = jax.jit(losses.value_loss, static_argnames=("clip_eps", "aggregation"))
dpo_loss = jax.jit(losses.dpo_loss, static_argnames=("beta",))

# Row 0: four trained tokens; row 1: one trained token; row 2: padding (no trained token).
_PER_TOKEN = jnp.array([[1.0, 2.0, 3.0, 4.0], [6.0, 50.0, 50.0, 50.0], [99.0, 99.0, 99.0, 99.0]])
_MASK = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], jnp.float32)


def test_aggregations_differ_as_expected_on_unequal_lengths():
  # token-mean:           (1 + 2 + 3 + 4 + 6) / 5 = 3.2   (each token weighs the same)
  # seq-mean-token-mean:  (10 / 4 + 6 / 1) / 2   = 4.25  (each trajectory weighs the same)
  # seq-mean-token-sum:   (10 + 6) / 2           = 8.0
  # The padding row counts in none of them, and masked 50s / 99s never leak in.
  assert float(aggregate(_PER_TOKEN, _MASK, "token-mean")) == pytest.approx(3.2)
  assert float(aggregate(_PER_TOKEN, _MASK, "seq-mean-token-mean")) == pytest.approx(4.25)
  assert float(aggregate(_PER_TOKEN, _MASK, "seq-mean-token-sum")) == pytest.approx(8.0)


def test_aggregation_of_an_empty_batch_is_zero_not_nan():
  for aggregation in losses.AGGREGATIONS:
    assert float(aggregate(_PER_TOKEN, jnp.zeros_like(_MASK), aggregation)) == 0.0


def test_unknown_aggregation_lists_the_valid_ones():
  with pytest.raises(
      ValueError, match="'seq-mean-token-mean', 'seq-mean-token-sum', "
      "'seq-mean-token-sum-norm', 'token-mean'"):
    losses.aggregate(_PER_TOKEN, _MASK, "sum")


# Five tokens with ratios rho and advantages A, eps = 0.2:
#   rho 0.5, A +1: max(-0.5, -0.8) = -0.5   unclipped
#   rho 1.5, A +1: max(-1.5, -1.2) = -1.2   clipped
#   rho 0.5, A -1: max( 0.5,  0.8) =  0.8   clipped
#   rho 1.5, A -1: max( 1.5,  1.2) =  1.5   unclipped
#   rho 1.0, A +2: max(-2.0, -2.0) = -2.0   tie, not counted as clipped
_RATIOS = np.array([[0.5, 1.5, 0.5, 1.5, 1.0]], np.float32)
_ADVANTAGES = jnp.array([[1.0, 1.0, -1.0, -1.0, 2.0]])
_OLD = jnp.full((1, 5), -2.0)
_NEW = _OLD + jnp.log(_RATIOS)
_ONES = jnp.ones((1, 5))


def test_policy_loss_clip_fraction_and_value():
  loss, metrics = policy_gradient_loss(_NEW, _OLD, _ADVANTAGES, _ONES)
  # (-0.5 - 1.2 + 0.8 + 1.5 - 2.0) / 5 = -0.28; 2 of 5 tokens clipped.
  assert float(loss) == pytest.approx(-0.28, abs=1e-6)
  assert float(metrics["clip_fraction"]) == pytest.approx(0.4)
  assert float(metrics["dual_clip_fraction"]) == 0.0
  assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
  assert float(metrics["ratio_max"]) == pytest.approx(1.5, abs=1e-6)
  # k3 of KL(old || new): mean of rho - 1 - log rho
  #   = (2 * (0.5 - 1 - log 0.5) + 2 * (1.5 - 1 - log 1.5) + 0) / 5
  expected_kl = (2 * (-0.5 + math.log(2)) + 2 * (0.5 - math.log(1.5))) / 5
  assert float(metrics["approx_kl"]) == pytest.approx(expected_kl, abs=1e-6)


def test_clip_higher_only_widens_the_upper_bound():
  # eps_high 0.6: rho 1.5 with A +1 now sits inside [0.8, 1.6] -> -1.5, unclipped.
  # The lower bound is still 0.8 (rho 0.5, A -1 stays clipped at 0.8).
  # Loss (-0.5 - 1.5 + 0.8 + 1.5 - 2.0) / 5 = -0.34; 1 of 5 clipped.
  loss, metrics = policy_gradient_loss(_NEW, _OLD, _ADVANTAGES, _ONES, clip=losses.Clip(0.2, 0.6))
  assert float(loss) == pytest.approx(-0.34, abs=1e-6)
  assert float(metrics["clip_fraction"]) == pytest.approx(0.2)


def test_dual_clip_bounds_negative_advantages_only():
  # rho 5 with A -1: the PPO loss is max(5, 1.2) = 5; dual clip c = 3 caps it at 3, with no
  # gradient. rho 5 with A +1: max(-5, -1.2) = -1.2, untouched by dual clip.
  new = jnp.log(jnp.array([[5.0, 5.0]]))
  old = jnp.zeros((1, 2))
  advantages = jnp.array([[-1.0, 1.0]])
  mask = jnp.ones((1, 2))
  plain, _ = policy_gradient_loss(new, old, advantages, mask)
  assert float(plain) == pytest.approx((5.0 - 1.2) / 2, abs=1e-5)
  dual, metrics = policy_gradient_loss(new, old, advantages, mask,
                                       clip=losses.Clip(0.2, dual_c=3.0))
  assert float(dual) == pytest.approx((3.0 - 1.2) / 2, abs=1e-5)
  assert float(metrics["dual_clip_fraction"]) == pytest.approx(0.5)
  grad = jax.grad(lambda logp: policy_gradient_loss(logp, old, advantages, mask, clip=losses.Clip(
      0.2, dual_c=3.0))[0])(new)
  np.testing.assert_array_equal(grad, 0.0)


def test_policy_loss_ignores_untrained_tokens():
  # An observation token with a wild ratio (e^10) must not show in the loss or the metrics.
  new = jnp.concatenate([_NEW, jnp.full((1, 1), 8.0)], axis=1)
  old = jnp.concatenate([_OLD, jnp.full((1, 1), -2.0)], axis=1)
  advantages = jnp.concatenate([_ADVANTAGES, jnp.full((1, 1), -3.0)], axis=1)
  mask = jnp.concatenate([_ONES, jnp.zeros((1, 1))], axis=1)
  loss, metrics = policy_gradient_loss(new, old, advantages, mask)
  assert float(loss) == pytest.approx(-0.28, abs=1e-6)
  assert float(metrics["ratio_max"]) == pytest.approx(1.5, abs=1e-6)


def test_policy_loss_rejects_bad_clip_settings():
  with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
    losses.Clip(0.2, dual_c=0.5)
  with pytest.raises(ValueError, match="Clip epsilons must be > 0"):
    losses.Clip(0.2, 0.0)
  with pytest.raises(ValueError, match="GSPO has no dual clip"):
    losses.gspo_loss(_NEW, _OLD, _ADVANTAGES, _ONES, clip=losses.Clip(3e-4, dual_c=3.0))


def test_kl_estimators_worked_values():
  # d = logp - logp_ref:
  #   d = +1 (logp -1, ref -2): k1 = 1,  k2 = 0.5, k3 = e^-1 + 1 - 1 = 0.367879
  #   d = -1 (logp -2, ref -1): k1 = -1, k2 = 0.5, k3 = e^1 - 1 - 1  = 0.718282
  #   d =  0:                   all 0
  logp = jnp.array([[-1.0, -2.0, -3.0]])
  ref = jnp.array([[-2.0, -1.0, -3.0]])
  np.testing.assert_allclose(kl_divergence(logp, ref, "k1"), [[1.0, -1.0, 0.0]], atol=1e-6)
  np.testing.assert_allclose(kl_divergence(logp, ref, "k2"), [[0.5, 0.5, 0.0]], atol=1e-6)
  expected_k3 = [[math.exp(-1), math.e - 2, 0.0]]
  np.testing.assert_allclose(kl_divergence(logp, ref, "k3"), expected_k3, atol=1e-6)
  np.testing.assert_allclose(kl_divergence(logp, ref, "low_var_kl"), expected_k3, atol=1e-6)


def test_k3_is_clamped_at_ten_with_no_gradient_beyond():
  # d = -5: e^5 - 5 - 1 = 142.4 -> 10. d = -2: e^2 - 3 = 4.389, inside the clamp.
  logp = jnp.array([[-5.0, -2.0]])
  ref = jnp.zeros((1, 2))
  np.testing.assert_allclose(kl_divergence(logp, ref, "k3"), [[10.0, math.exp(2) - 3]], rtol=1e-6)
  grad = jax.grad(lambda x: jnp.sum(kl_divergence(x, ref, "k3")))(logp)
  # d k3 / d logp = 1 - e^(ref - logp): 0 where clamped, 1 - e^2 inside.
  np.testing.assert_allclose(grad, [[0.0, 1 - math.exp(2)]], rtol=1e-5)


# jax.numpy.abs's derivative at 0 (a subgradient in [-1, 1]).
ABS_GRAD_AT_0 = float(jax.grad(jnp.abs)(0.0))


def test_kl_estimators_answer_to_verls_names_too():
  # verl's kl / mse / low_var_kl are k1 / k2 / k3; abs is |d|: d = -1.5 -> 1.5.
  for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
    assert losses.KL_ESTIMATORS[alias] is losses.KL_ESTIMATORS[name]
  logp, ref = jnp.array([[-2.5, -1.0]]), jnp.array([[-1.0, -1.0]])
  np.testing.assert_allclose(kl_divergence(logp, ref, "abs"), [[1.5, 0.0]])


@pytest.mark.parametrize("estimator", sorted(losses.KL_ESTIMATORS))
def test_kl_estimators_are_finite_with_finite_gradients_far_off_policy(estimator):
  # exp(-d) overflows f32 below d = -88.7; k3 bounds d to [-20, 20] first, where every estimate
  # is already beyond its clamp of 10, so values stay as the formula gives and gradients are 0.
  #   k1 = d, d k1/d logp = 1;  k2 = d^2 / 2, d k2/d logp = d;  k3 = min(exp(-d) + d - 1, 10).
  d = jnp.array([[-100.0, -30.0, 0.0, 30.0, 100.0]])
  ref = jnp.zeros_like(d)
  expected = {
      "k1": ([-100.0, -30.0, 0.0, 30.0, 100.0], [1.0] * 5),
      "k2": ([5000.0, 450.0, 0.0, 450.0, 5000.0], [-100.0, -30.0, 0.0, 30.0, 100.0]),
      "k3": ([10.0, 10.0, 0.0, 10.0, 10.0], [0.0] * 5),
      "abs": ([100.0, 30.0, 0.0, 30.0, 100.0], [-1.0, -1.0, ABS_GRAD_AT_0, 1.0, 1.0]),
  }[{"low_var_kl": "k3", "kl": "k1", "mse": "k2"}.get(estimator, estimator)]
  value = kl_divergence(d, ref, estimator)
  grad = jax.grad(lambda x: jnp.sum(kl_divergence(x, ref, estimator)))(d)
  np.testing.assert_allclose(value, [expected[0]], rtol=1e-6)
  np.testing.assert_allclose(grad, [expected[1]], rtol=1e-6)


def test_kl_loss_and_penalty_rewards():
  logp = jnp.array([[-1.0, -2.0, -7.0]])
  ref = jnp.array([[-2.0, -1.0, -1.0]])
  mask = jnp.array([[1.0, 1.0, 0.0]])
  # k1 over trained tokens: (1 - 1) / 2 = 0; k2: (0.5 + 0.5) / 2 = 0.5.
  loss, metrics = losses.kl_loss(logp, ref, mask, estimator="k2")
  assert float(loss) == pytest.approx(0.5) and float(metrics["kl"]) == pytest.approx(0.5)
  # Reward penalty -beta * k1 = -0.1 * [1, -1] on trained tokens, 0 on the observation token.
  penalty = losses.kl_penalty_rewards(logp, ref, mask, beta=0.1)
  np.testing.assert_allclose(penalty, [[-0.1, 0.1, 0.0]], atol=1e-7)
  with pytest.raises(ValueError, match="Unknown KL estimator 'k4'"):
    losses.kl_divergence(logp, ref, "k4")


def test_entropy_bonus_is_the_aggregated_entropy():
  # Same numbers as the aggregation test: token-mean 3.2, seq-mean-token-mean 4.25.
  bonus, metrics = losses.entropy_bonus(_PER_TOKEN, _MASK, aggregation="token-mean")
  assert float(bonus) == pytest.approx(3.2) and float(metrics["entropy"]) == pytest.approx(3.2)
  bonus, _ = losses.entropy_bonus(_PER_TOKEN, _MASK, aggregation="seq-mean-token-mean")
  assert float(bonus) == pytest.approx(4.25)


def test_clipped_value_loss_worked_values():
  # eps 0.2, three tokens (v, v_old, R):
  #   (1.0, 0.5, 2.0): clip(1.0, 0.3, 0.7) = 0.7; max(1.0, 1.69) = 1.69   clipped
  #   (1.0, 0.9, 0.0): clip -> 1.0;               max(1.0, 1.0)  = 1.0    tie
  #   (0.2, 0.5, 0.0): clip -> 0.3;               max(0.04, 0.09) = 0.09  clipped
  # loss = 0.5 * (1.69 + 1.0 + 0.09) / 3 = 0.463333
  values = jnp.array([[1.0, 1.0, 0.2]])
  old_values = jnp.array([[0.5, 0.9, 0.5]])
  returns = jnp.array([[2.0, 0.0, 0.0]])
  loss, metrics = value_loss(values, old_values, returns, jnp.ones((1, 3)))
  assert float(loss) == pytest.approx(0.5 * 2.78 / 3, abs=1e-6)
  assert float(metrics["value_clip_fraction"]) == pytest.approx(2 / 3)
  assert float(metrics["value_mse"]) == pytest.approx((1.0 + 1.0 + 0.04) / 3, abs=1e-6)


def test_sft_loss_is_masked_token_mean_nll():
  # Trained log-probs -1, -2 -> NLL 1.5; the masked -100 is a prompt token.
  loss, _ = losses.sft_loss(jnp.array([[-1.0, -2.0, -100.0]]), jnp.array([[1.0, 1.0, 0.0]]))
  assert float(loss) == pytest.approx(1.5)


def test_dpo_worked_value():
  # Pair 0: beta 0.5, pi_c -10, ref_c -12, pi_r -15, ref_r -14:
  #   r_c = 0.5 * 2 = 1, r_r = 0.5 * -1 = -0.5, margin 1.5, loss log(1 + e^-1.5) = 0.201413
  # Pair 1: the mirror image, margin -1.5, loss log(1 + e^1.5) = 1.701413
  chosen = jnp.array([-10.0, -15.0])
  rejected = jnp.array([-15.0, -10.0])
  ref_chosen = jnp.array([-12.0, -14.0])
  ref_rejected = jnp.array([-14.0, -12.0])
  loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
  expected = (math.log1p(math.exp(-1.5)) + math.log1p(math.exp(1.5))) / 2
  assert float(loss) == pytest.approx(expected, abs=1e-6)
  assert float(metrics["reward_accuracy"]) == pytest.approx(0.5)
  assert float(metrics["reward_margin"]) == pytest.approx(0.0, abs=1e-6)
  assert float(metrics["chosen_reward"]) == pytest.approx((1.0 - 0.5) / 2)
  single, single_metrics = dpo_loss(chosen[:1], rejected[:1], ref_chosen[:1], ref_rejected[:1],
                                    beta=0.5)
  assert float(single) == pytest.approx(0.201413, abs=1e-6)
  assert float(single_metrics["reward_accuracy"]) == 1.0


def test_sequence_logprobs_sum_trained_tokens():
  token_logprobs = jnp.array([[-1.0, -2.0, -5.0], [-0.5, -9.0, -9.0]])
  mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  np.testing.assert_allclose(losses.sequence_logprobs(token_logprobs, mask), [-3.0, -0.5])


_B, _T, _D, _V = 2, 11, 8, 37


def _problem():
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(_B, _T, _D)).astype(np.float32)
  unembedding = 2.0 * rng.normal(size=(_D, _V)).astype(np.float32)
  targets = rng.integers(0, _V, size=(_B, _T), dtype=np.int32)
  return jnp.asarray(hidden), jnp.asarray(unembedding), jnp.asarray(targets)


@jax.jit
def _reference_logprobs_and_entropy(logits, targets):
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  token = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  return token, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def test_token_logprobs_and_entropy_match_log_softmax():
  hidden, unembedding, targets = _problem()

  @jax.jit
  def compare(logits, targets):
    ours = losses.token_logprobs_and_entropy(logits, targets)
    # bf16 logits are promoted to f32 before the softmax; temperature divides the logits.
    bf16 = logits.astype(jnp.bfloat16)
    ours_tempered = losses.token_logprobs_and_entropy(bf16, targets, temperature=0.7)
    reference_tempered = _reference_logprobs_and_entropy(bf16.astype(jnp.float32) / 0.7, targets)
    return ours, _reference_logprobs_and_entropy(logits, targets), ours_tempered, reference_tempered

  ours, reference, ours_tempered, reference_tempered = compare(hidden @ unembedding, targets)
  for actual, expected in zip(ours + ours_tempered, reference + reference_tempered):
    assert actual.dtype == jnp.float32
    np.testing.assert_allclose(actual, expected, atol=1e-5)


def _chunked(hidden, unembedding, targets, chunk_size, **options):
  return losses.chunked_token_logprobs_and_entropy(hidden, targets, unembedding, vocab_major=False,
                                                   chunk_size=chunk_size, **options)


def _objective(logprobs_and_entropy):
  # Weights make every output position matter differently in the gradient.
  logprobs, entropies = logprobs_and_entropy
  weights = jnp.arange(logprobs.size, dtype=jnp.float32).reshape(logprobs.shape) / logprobs.size
  return jnp.sum(weights * logprobs) + 0.3 * jnp.sum(weights[::-1] * entropies)


# (chunk, block, temperature, the weight as a tied embedding [V, E] or as an lm_head [E, V])
@pytest.mark.parametrize("chunk_size, block_size, temperature, vocab_major", [(4, None, 1.0, False),
                                                                              (4, 1, 1.0, True),
                                                                              (6, 4, 0.7, False),
                                                                              (11, 3, 1.3, True)])
def test_chunked_logprobs_match_unchunked_values_and_gradients(chunk_size, block_size, temperature,
                                                               vocab_major):
  hidden, unembedding, targets = _problem()

  def chunked(h, w):
    # T = 11 is not a multiple of 4 or 6: the last chunk is padded and the padding dropped. A
    # block_size that does not divide the chunk becomes the largest divisor below it.
    return losses.chunked_token_logprobs_and_entropy(h, targets, w.T if vocab_major else w,
                                                     vocab_major=vocab_major, chunk_size=chunk_size,
                                                     block_size=block_size, temperature=temperature)

  @jax.jit
  def compare(hidden, unembedding):
    unchunked = losses.token_logprobs_and_entropy(hidden @ unembedding, targets,
                                                  temperature=temperature)
    chunked_grads = jax.grad(lambda h, w: _objective(chunked(h, w)), argnums=(0, 1))(hidden,
                                                                                     unembedding)
    reference_grads = jax.grad(
        lambda h, w: _objective(_reference_logprobs_and_entropy(h @ w / temperature, targets)),
        argnums=(0, 1))(hidden, unembedding)
    return chunked(hidden, unembedding), unchunked, chunked_grads, reference_grads

  values, unchunked, chunked_grads, reference_grads = compare(hidden, unembedding)
  for actual, expected in zip(values, unchunked):
    assert float(jnp.max(jnp.abs(actual - expected))) < 1e-5
  for actual, expected in zip(chunked_grads, reference_grads):
    np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=1e-4)


def test_bf16_chunked_logprobs_differentiate_with_bf16_matmuls():
  """With bf16 matmul inputs, the values are those of bf16-input logits, and the gradient is
  the exact gradient of that function up to the rounding of the logits' cotangent dz to bf16
  before its two matmuls: each gradient entry is a sum over the V (or B T) entries of dz times
  bf16 weights (or hidden states), each term off by at most u = 2^-9 relative, and these
  roundings add as a random walk, so an entry moves by ~sqrt(V) u max|dz| max|w| (tolerance:
  tolerances.SAFETY times that)."""
  hidden, unembedding, targets = _problem()
  bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  f = lambda h, w: _chunked(h, w, targets, 4, dtype=jnp.bfloat16)
  reference = lambda h, w: _reference_logprobs_and_entropy(bf16(h) @ bf16(w), targets)

  for actual, expected in zip(f(hidden, unembedding), reference(hidden, unembedding)):
    np.testing.assert_allclose(actual, expected, atol=1e-5)
  grad = jax.jit(jax.grad(lambda h, w: _objective(f(h, w)), (0, 1)))
  d_hidden, d_weight = grad(hidden, unembedding)
  ref_hidden, ref_weight = jax.grad(lambda h, w: _objective(reference(h, w)), (0, 1))(hidden,
                                                                                      unembedding)
  dz = jax.grad(lambda z: _objective(_reference_logprobs_and_entropy(z, targets)))(
      bf16(hidden) @ bf16(unembedding))
  scale = float(jnp.max(jnp.abs(dz)))
  for actual, expected, other, terms in ((d_hidden, ref_hidden, unembedding, _V),
                                         (d_weight, ref_weight, hidden, _B * _T)):
    bound = tolerances.SAFETY * math.sqrt(terms) * 2.0**-9 * scale * float(jnp.max(jnp.abs(other)))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=bound)


def _largest_intermediate(closed_jaxpr) -> int:
  """Element count of the largest value any equation produces, sub-jaxprs included."""
  largest = 0

  def visit(jaxpr):
    nonlocal largest
    for equation in jaxpr.eqns:
      for var in equation.outvars:
        largest = max(largest, math.prod(getattr(var.aval, "shape", ())))
      for param in equation.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if isinstance(sub, jax_core.ClosedJaxpr):
            visit(sub.jaxpr)
          elif isinstance(sub, jax_core.Jaxpr):
            visit(sub)

  visit(closed_jaxpr.jaxpr)
  return largest


def test_chunked_logprobs_never_materialise_full_logits():
  hidden, unembedding, targets = _problem()
  full_logits = _B * _T * _V
  chunk_logits = _B * 4 * _V

  def loss(h, w):
    return _objective(_chunked(h, w, targets, 4))

  forward = jax.make_jaxpr(lambda h, w: _chunked(h, w, targets, 4))(hidden, unembedding)
  backward = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, unembedding)
  assert _largest_intermediate(forward) == chunk_logits < full_logits
  assert _largest_intermediate(backward) == chunk_logits
  # The check itself can fail: the unchunked computation does hold [B, T, V].
  unchunked = jax.make_jaxpr(lambda h, w: losses.token_logprobs_and_entropy(h @ w, targets))(
      hidden, unembedding)
  assert _largest_intermediate(unchunked) == full_logits


def test_chunk_size_must_be_positive():
  hidden, unembedding, targets = _problem()
  with pytest.raises(ValueError, match="chunk_size must be > 0"):
    _chunked(hidden, unembedding, targets, 0)
