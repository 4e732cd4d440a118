"""GSPO, CISPO, importance weights and Dr. GRPO's constant divisor: worked values and gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax.rl import losses
from rl_helpers import check_config
from test_losses import _ADVANTAGES, _MASK, _NEW, _OLD, _ONES, _PER_TOKEN

aggregate = jax.jit(losses.aggregate, static_argnames=("aggregation", "scale_tokens"))
_STATIC = ("clip", "aggregation", "scale_tokens")
gspo_loss = jax.jit(losses.gspo_loss, static_argnames=_STATIC)
cispo_loss = jax.jit(losses.cispo_loss, static_argnames=_STATIC)
policy_gradient_loss = jax.jit(losses.policy_gradient_loss, static_argnames=_STATIC)


def test_seq_mean_token_sum_norm_divides_by_a_constant():
  # test_losses' rows of 4 and 1 trained tokens and a padding row.
  # seq-mean-token-sum: (10 + 6) / 2 = 8; divided by L = 10: 0.8; by default L = T = 4: 2.0.
  assert float(aggregate(_PER_TOKEN, _MASK, "seq-mean-token-sum-norm",
                         scale_tokens=10.0)) == pytest.approx(0.8)
  assert float(aggregate(_PER_TOKEN, _MASK, "seq-mean-token-sum-norm")) == pytest.approx(2.0)
  # Every trained token's gradient is 1 / (rows with tokens x L) = 1 / 20, whatever its row's
  # length; seq-mean-token-mean gives row 0's tokens 1/8 and row 1's token 1/2.
  grad = jax.grad(lambda x: aggregate(x, _MASK, "seq-mean-token-sum-norm", scale_tokens=10.0))(
      _PER_TOKEN)
  np.testing.assert_allclose(grad, 0.05 * _MASK, rtol=1e-6)
  grad = jax.grad(lambda x: aggregate(x, _MASK, "seq-mean-token-mean"))(_PER_TOKEN)
  np.testing.assert_allclose(grad[:2, 0], [0.125, 0.5], rtol=1e-6)


def test_only_the_scaled_aggregation_takes_a_divisor():
  with pytest.raises(ValueError, match="'token-mean' takes no scale_tokens"):
    losses.aggregate(_PER_TOKEN, _MASK, "token-mean", scale_tokens=10.0)
  with pytest.raises(ValueError, match="scale_tokens must be > 0"):
    losses.aggregate(_PER_TOKEN, _MASK, "seq-mean-token-sum-norm", scale_tokens=0.0)


# Two trajectories of two tokens each, clip 0.2 (a test range; GSPO's own is 3e-4 / 4e-4):
#   row 0: rho = [1.5, 1.5], s_0 = 1.5, A = +1: max(-1.5, -1.2) = -1.2   clipped, no gradient
#   row 1: rho = [2.0, 0.5], s_1 = exp((log 2 + log 0.5) / 2) = 1, A = -1: max(1, 1) = 1
# seq-mean-token-mean: (-1.2 + 1) / 2 = -0.1. PPO per token would clip row 1's second token
# (0.5 < 0.8) and let its first (ratio 2, A -1) through with gradient 2: GSPO sees one ratio.
_GSPO_OLD = jnp.array([[-1.0, -2.0], [-1.5, -0.5]])
_GSPO_NEW = _GSPO_OLD + jnp.log(jnp.array([[1.5, 1.5], [2.0, 0.5]]))
_GSPO_ADVANTAGES = jnp.array([[1.0, 1.0], [-1.0, -1.0]])
_GSPO_MASK = jnp.ones((2, 2))


def test_gspo_clips_one_length_normalised_ratio_per_trajectory():
  loss, metrics = gspo_loss(_GSPO_NEW, _GSPO_OLD, _GSPO_ADVANTAGES, _GSPO_MASK,
                            clip=losses.Clip(0.2, 0.2))
  assert float(loss) == pytest.approx(-0.1, abs=1e-6)
  assert float(metrics["clip_fraction"]) == pytest.approx(0.5)  # Row 0's two tokens.
  assert float(metrics["ratio_mean"]) == pytest.approx((2 * 1.5 + 2 * 1.0) / 4, abs=1e-6)
  assert float(metrics["ratio_max"]) == pytest.approx(1.5, abs=1e-6)
  # d loss / d logp_1,t = (1/2 rows) (1/2 tokens) (-A_1 s_1) = 0.25; row 0 is clipped: 0.
  grad = jax.grad(lambda logp: gspo_loss(logp, _GSPO_OLD, _GSPO_ADVANTAGES, _GSPO_MASK, clip=losses.
                                         Clip(0.2, 0.2))[0])(_GSPO_NEW)
  np.testing.assert_allclose(grad, [[0.0, 0.0], [0.25, 0.25]], atol=1e-6)


def _gspo_by_definition(logprobs, old_logprobs, advantages, loss_mask, eps_low, eps_high):
  """GSPO as the paper writes it: s_i differentiated as a whole, one advantage a row."""
  sequence_ratio = jnp.exp(
      jnp.sum((logprobs - old_logprobs) * loss_mask, axis=1) / jnp.sum(loss_mask, axis=1))
  advantage = advantages[:, 0]
  objective = jnp.minimum(sequence_ratio * advantage,
                          jnp.clip(sequence_ratio, 1 - eps_low, 1 + eps_high) * advantage)
  return -jnp.mean(objective)


def test_gspo_token_form_has_the_gradient_of_gspo_itself():
  # Random trajectories of unequal lengths, log-ratios of +-1e-3 around GSPO's clip range
  # (3e-4 / 4e-4), so some are clipped and some not; one advantage a row.
  rng = np.random.default_rng(0)
  old = jnp.asarray(rng.normal(-3.0, 1.0, (6, 9)), jnp.float32)
  new = old + jnp.asarray(rng.uniform(-1e-3, 1e-3, (6, 9)), jnp.float32)
  lengths = np.array([9, 7, 5, 3, 2, 1])
  mask = jnp.asarray(np.arange(9)[None, :] < lengths[:, None], jnp.float32)
  advantages = jnp.asarray(rng.choice([-1.5, 0.5, 1.0], size=(6, 1)) * np.ones((1, 9)), jnp.float32)
  ours = lambda logp: gspo_loss(logp, old, advantages, mask)[0]
  reference = lambda logp: _gspo_by_definition(logp, old, advantages, mask, 3e-4, 4e-4)
  _, metrics = gspo_loss(new, old, advantages, mask)
  assert 0.0 < float(metrics["clip_fraction"]) < 1.0
  # Both are -mean_i of the same f32 terms: equal to the rounding of a 6-term mean.
  assert float(ours(new)) == pytest.approx(float(reference(new)), rel=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(new), jax.grad(reference)(new), rtol=1e-5, atol=1e-7)


def test_gspo_sequence_ratio_keeps_its_precision_next_to_large_log_probs():
  # log s ~ 3.5e-4 next to log-probs of -40..-60 (an f32 ulp of 3.8e-6 there): every token's
  # ratio must be exp(mean log-ratio) to the rounding of exp() (an ulp of 1, 2^-23). Summed in
  # the order log s + logp - logp, log s takes logp's rounding and the ratios stray by 4 ulps.
  rng = np.random.default_rng(0)
  old = jnp.asarray(rng.uniform(-60.0, -40.0, (1, 64)), jnp.float32)
  new = old + jnp.asarray(rng.uniform(3e-4, 4e-4, (1, 64)), jnp.float32)
  expected = math.exp(float(jnp.mean(new - old)))
  _, metrics = gspo_loss(new, old, jnp.ones((1, 64)), jnp.ones((1, 64)))
  assert float(metrics["ratio_max"]) == pytest.approx(expected, abs=2 * 2.0**-23)
  assert float(metrics["clip_fraction"]) == 0.0


# CISPO, eps 0.2 each way (test values): three tokens
#   rho 0.9, A +1: weight 0.9 (inside [0.8, 1.2]);  gradient of -w A logp: -0.9
#   rho 1.5, A -1: weight 1.2 (clipped);             gradient +1.2  (PPO: +1.5, unclipped)
#   rho 8.0, A +1: weight 1.2 (clipped);             gradient -1.2  (PPO: 0, clipped away)
# token-mean divides each by 3.
_CISPO_OLD = jnp.array([[-2.0, -2.0, -3.0]])
_CISPO_RATIOS = jnp.array([[0.9, 1.5, 8.0]])
_CISPO_NEW = _CISPO_OLD + jnp.log(_CISPO_RATIOS)
_CISPO_ADVANTAGES = jnp.array([[1.0, -1.0, 1.0]])


def test_cispo_clips_a_stop_gradient_weight_and_keeps_every_token_gradient():
  mask = jnp.ones((1, 3))
  loss, metrics = cispo_loss(_CISPO_NEW, _CISPO_OLD, _CISPO_ADVANTAGES, mask,
                             clip=losses.Clip(0.2, 0.2))
  new = np.asarray(_CISPO_NEW)[0]
  expected = (-0.9 * new[0] + 1.2 * new[1] - 1.2 * new[2]) / 3
  assert float(loss) == pytest.approx(expected, abs=1e-6)
  assert float(metrics["clip_fraction"]) == pytest.approx(2 / 3)
  grad = jax.grad(lambda logp: cispo_loss(logp, _CISPO_OLD, _CISPO_ADVANTAGES, mask, clip=losses.
                                          Clip(0.2, 0.2))[0])(_CISPO_NEW)
  np.testing.assert_allclose(grad, [[-0.9 / 3, 1.2 / 3, -1.2 / 3]], rtol=1e-5)
  ppo_grad = jax.grad(lambda logp: policy_gradient_loss(logp, _CISPO_OLD, _CISPO_ADVANTAGES, mask,
                                                        clip=losses.Clip(0.2, 0.2))[0])(_CISPO_NEW)
  np.testing.assert_allclose(ppo_grad, [[-0.9 / 3, 1.5 / 3, 0.0]], rtol=1e-5)


def test_cispo_default_has_no_lower_bound():
  # eps_low = 1: the weight's lower bound is 0, so rho = 0.01 keeps its weight 0.01.
  old = jnp.zeros((1, 1))
  new = jnp.log(jnp.array([[0.01]]))
  grad = jax.grad(lambda logp: cispo_loss(logp, old, jnp.ones((1, 1)), jnp.ones((1, 1)))[0])(new)
  np.testing.assert_allclose(grad, [[-0.01]], rtol=1e-5)


def test_importance_weights_scale_each_token_loss_and_are_not_trained():
  # The five tokens of test_losses' clip example, per-token PPO losses
  # [-0.5, -1.2, 0.8, 1.5, -2.0]; weights [2, 1, 1, 1, 0.5] -> [-1.0, -1.2, 0.8, 1.5, -1.0],
  # token-mean -0.9 / 5 = -0.18.
  weights = jnp.array([[2.0, 1.0, 1.0, 1.0, 0.5]])
  loss, _ = policy_gradient_loss(_NEW, _OLD, _ADVANTAGES, _ONES, importance_weights=weights)
  assert float(loss) == pytest.approx(-0.18, abs=1e-6)
  for loss_fn in (policy_gradient_loss, gspo_loss, cispo_loss):
    weight_grad = jax.grad(
        lambda w, f=loss_fn: f(_NEW, _OLD, _ADVANTAGES, _ONES, importance_weights=w)[0])(weights)
    np.testing.assert_array_equal(weight_grad, 0.0)


def test_policy_loss_registry_names_each_loss_and_its_config_keys():
  c = config_lib.base_config()
  for name, entry in losses.POLICY_LOSSES.items():
    assert losses.get_policy_loss(name) is entry
    for key in (entry.clip_keys or ()) + entry.options:
      assert key in c.algorithm
  assert [n for n, e in losses.POLICY_LOSSES.items() if e.dual_clip] == ["ppo"]
  assert [n for n, e in losses.POLICY_LOSSES.items() if e.draws] == ["clip_cov"]
  with pytest.raises(
      ValueError, match="Unknown policy loss 'grpo'; expected one of: 'cispo', "
      "'clip_cov', 'gspo', 'kl_cov', 'ppo'"):
    losses.get_policy_loss("grpo")


@pytest.mark.parametrize("key, value, message", [
    ("policy_loss", "dapo", r"algorithm.policy_loss='dapo' is not one of \['cispo', 'clip_cov'"),
    ("gspo_clip_eps_high", 0.0, r"algorithm.gspo_clip_eps_high=0.0 must be > 0"),
    ("cispo_clip_eps_low", 1.5, r"algorithm.cispo_clip_eps_low=1.5 must be <= 1"),
    ("dual_clip_c", 3.0, r"algorithm.dual_clip_c=3.0 is PPO's; algorithm.policy_loss='gspo' "
     r"has no dual clip"),
    ("loss_scale_tokens", 512, r"algorithm.loss_scale_tokens=512 is the divisor of "
     r"seq-mean-token-sum-norm; algorithm.aggregation='token-mean'"),
    ("loss_scale_tokens", -1, r"algorithm.loss_scale_tokens=-1 must be >= 0"),
])
def test_policy_loss_keys_are_validated_at_start_up(key, value, message):
  c = config_lib.base_config()
  c.algorithm.policy_loss = "gspo"
  settings_lib.Settings.from_config(c)
  c.algorithm[key] = value
  check_config(c, message)


def test_loss_settings_take_the_chosen_loss_clip_range_and_divisor():

  c = config_lib.base_config()
  loss = settings_lib.Settings.from_config(c).update.loss
  assert (loss.policy_loss, loss.clip_eps_low, loss.loss_scale_tokens) == ("ppo", 0.2, None)
  c.algorithm.policy_loss = "gspo"
  c.algorithm.aggregation = "seq-mean-token-sum-norm"
  loss = settings_lib.Settings.from_config(c).update.loss
  assert (loss.clip_eps_low, loss.clip_eps_high) == (3e-4, 4e-4)
  # 512 new tokens a turn x the largest cap of the stepwise schedule (10, 20, 30): 15360.
  assert loss.loss_scale_tokens == 512 * 30
  c.algorithm.loss_scale_tokens = 4096
  c.algorithm.policy_loss = "cispo"
  loss = settings_lib.Settings.from_config(c).update.loss
  assert (loss.clip_eps_low, loss.clip_eps_high, loss.loss_scale_tokens) == (1.0, 5.0, 4096.0)
