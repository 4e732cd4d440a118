"""Advantage estimators: worked examples, textbook-loop parity, outcome-reward placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax.rl import advantages as adv

# Every estimator is exercised under jit: that proves it traces with static shapes, and one
# compile per call is much faster than running the ops one by one.
grpo = jax.jit(adv.grpo_advantages, static_argnames=("num_groups", "normalize_by_std", "std"))
rloo = jax.jit(adv.rloo_advantages, static_argnames=("num_groups",))
reinforce_plus_plus = jax.jit(adv.reinforce_plus_plus_advantages)
gae = jax.jit(adv.gae_advantages)
place_on_last_trained_token = jax.jit(adv.place_on_last_trained_token)


def _whiten(values):
  values = np.asarray(values, np.float64)
  return (values - values.mean()) / np.sqrt(values.var() + 1e-8)


def test_grpo_worked_example_single_group():
  # Group rewards [1, 0, 0, 1] -> mean 0.5, population std 0.5 -> [1, -1, -1, 1] (eps ~ 0).
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0])
  mask = jnp.ones((4, 3))
  out = grpo(rewards, mask, jnp.zeros(4, jnp.int32), num_groups=1)
  np.testing.assert_allclose(out, np.tile([[1.0], [-1.0], [-1.0], [1.0]], (1, 3)), atol=1e-5)


def test_grpo_without_std_normalisation():
  # Dr. GRPO: [1, 0, 0, 0] -> mean 0.25 -> [0.75, -0.25, -0.25, -0.25], no division.
  rewards = jnp.array([1.0, 0.0, 0.0, 0.0])
  out = grpo(rewards, jnp.ones((4, 1)), jnp.zeros(4, jnp.int32), num_groups=1,
             normalize_by_std=False)
  np.testing.assert_allclose(out[:, 0], [0.75, -0.25, -0.25, -0.25], atol=1e-7)


def test_grpo_zero_for_singleton_and_uniform_groups():
  # Group 0 = {3.0} (size 1), group 1 = {1, 1, 1} (all equal), group 2 = {0, 2}: mean 1, std 1.
  rewards = jnp.array([3.0, 1.0, 1.0, 1.0, 0.0, 2.0])
  group_ids = jnp.array([0, 1, 1, 1, 2, 2])
  out = grpo(rewards, jnp.ones((6, 2)), group_ids, num_groups=3)
  np.testing.assert_allclose(out[:, 0], [0, 0, 0, 0, -1, 1], atol=1e-5)


def test_grpo_without_eps_scores_singleton_and_uniform_groups_zero():
  # eps = 0: groups {3.0} and {1, 1} would divide 0 by 0; {0, 2} -> [-1, 1].
  out = grpo(jnp.array([3.0, 1.0, 1.0, 0.0, 2.0]), jnp.ones((5, 1)), jnp.array([0, 1, 1, 2, 2]),
             num_groups=3, eps=0.0)
  np.testing.assert_array_equal(out[:, 0], [0, 0, 0, -1, 1])


@pytest.mark.parametrize("value, size", [(0.7, 8), (0.1, 16), (1.0 / 3.0, 6)])
def test_grpo_scores_a_group_of_equal_inexact_rewards_exactly_zero(value, size):
  # Eight 0.7s average to 0.7 + 1 ulp in f32; over a std of ~1e-8 that was a score of ~0.06.
  rewards = jnp.full(size, value, jnp.float32)
  out = grpo(rewards, jnp.ones((size, 1)), jnp.zeros(size, jnp.int32), num_groups=1)
  np.testing.assert_array_equal(out, 0.0)


def test_negative_advantages_are_weighted_and_positive_ones_kept():
  # [1, -1, -1, 1] with w = 0.25 -> [1, -0.25, -0.25, 1]; w = 0 keeps the successes only.
  advantages = jnp.array([[1.0, 1.0], [-1.0, -1.0], [-1.0, 0.0], [1.0, 0.0]])
  np.testing.assert_array_equal(adv.weight_negatives(advantages, 0.25),
                                [[1, 1], [-0.25, -0.25], [-0.25, 0], [1, 0]])
  np.testing.assert_array_equal(adv.weight_negatives(advantages, 0.0),
                                [[1, 1], [0, 0], [0, 0], [1, 0]])
  assert adv.weight_negatives(advantages, 1.0) is advantages
  with pytest.raises(ValueError, match="negative_weight must be >= 0, got -1"):
    adv.weight_negatives(advantages, -1.0)


def test_grpo_is_zero_on_untrained_tokens():
  rewards = jnp.array([1.0, 0.0])
  mask = jnp.array([[1, 0, 1, 0], [1, 1, 0, 0]], jnp.float32)
  out = grpo(rewards, mask, jnp.array([0, 0]), num_groups=1)
  # mean 0.5, std 0.5 -> +1 / -1 on trained tokens only.
  np.testing.assert_allclose(out, [[1, 0, 1, 0], [-1, -1, 0, 0]], atol=1e-5)


def test_group_statistics_are_invariant_to_group_order():
  rng = np.random.default_rng(0)
  rewards = rng.normal(size=12).astype(np.float32)
  group_ids = np.repeat(np.arange(3), 4)
  mask = jnp.ones((12, 1))
  permutation = rng.permutation(12)
  for estimator in (grpo, rloo):
    contiguous = estimator(jnp.asarray(rewards), mask, jnp.asarray(group_ids), num_groups=3)
    shuffled = estimator(jnp.asarray(rewards[permutation]), mask,
                         jnp.asarray(group_ids[permutation]), num_groups=3)
    np.testing.assert_allclose(shuffled, np.asarray(contiguous)[permutation], atol=1e-6)


def test_rloo_worked_example():
  # [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - (1 + 0 + 1) / 3 = -2/3.
  # A singleton group (reward 5) has no other sample -> 0.
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 5.0])
  group_ids = jnp.array([0, 0, 0, 0, 1])
  out = rloo(rewards, jnp.ones((5, 1)), group_ids, num_groups=2)
  np.testing.assert_allclose(out[:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0], atol=1e-6)


def test_place_on_last_trained_token():
  # Row 0: turn (0, 1), observation (2), turn (3, 4), observation/padding (5, 6): last = 4.
  # Row 1: no trained token -> no reward anywhere.
  mask = jnp.array([[1, 1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0]], jnp.float32)
  placed = place_on_last_trained_token(jnp.array([2.5, 7.0]), mask)
  expected = np.zeros((2, 7))
  expected[0, 4] = 2.5
  np.testing.assert_array_equal(placed, expected)


# Two multi-turn rows: turn, observation, turn, trailing observation (where the reference
# writes the outcome). gamma = 0.5.
_MASK = jnp.array([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], jnp.float32)


def test_reinforce_plus_plus_worked_example():
  # Row 0, outcome 1 on token 4, discounted over trained tokens 4 -> 1 -> 0 (the observation
  # tokens 2-3 neither discount nor cut): returns 1, 0.5, 0.25. Row 1, outcome 0: all 0.
  # Whitened over the 6 trained tokens [0.25, 0.5, 1, 0, 0, 0].
  out = reinforce_plus_plus(jnp.array([1.0, 0.0]), _MASK, gamma=0.5)
  np.testing.assert_allclose(out.returns, [[0.25, 0.5, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]], atol=1e-7)
  white = _whiten([0.25, 0.5, 1.0, 0.0, 0.0, 0.0])
  np.testing.assert_allclose(out.advantages[0, [0, 1, 4]], white[:3], atol=1e-5)
  np.testing.assert_allclose(out.advantages[1, :3], white[3:], atol=1e-5)
  np.testing.assert_array_equal(out.advantages * (1 - _MASK), 0.0)


def test_reinforce_plus_plus_adds_token_rewards():
  # A -0.1 KL penalty on every trained token of row 0, gamma 1: returns at tokens 4, 1, 0 are
  # 1 - 0.1 = 0.9, 0.9 - 0.1 = 0.8, 0.7. Penalties on untrained tokens (2, 5) are ignored.
  token_rewards = jnp.full((2, 6), -0.1).at[1].set(0.0)
  out = reinforce_plus_plus(jnp.array([1.0, 0.0]), _MASK, token_rewards=token_rewards, gamma=1.0)
  np.testing.assert_allclose(out.returns[0], [0.7, 0.8, 0, 0, 0.9, 0], atol=1e-6)


def test_outcome_on_a_masked_token_is_lost_and_ours_is_not():
  # The reference's layout: outcome 1 on the final response token (5), an observation token.
  # Rewards on untrained tokens never enter, so every return and advantage is 0: the success
  # teaches nothing. Passing the outcome as `rewards` places it on token 4 instead.
  reference_layout = jnp.zeros((2, 6)).at[0, 5].set(1.0)
  lost = reinforce_plus_plus(jnp.zeros(2), _MASK, token_rewards=reference_layout, gamma=0.5)
  np.testing.assert_array_equal(lost.advantages, 0.0)
  ours = reinforce_plus_plus(jnp.array([1.0, 0.0]), _MASK, gamma=0.5)
  assert float(jnp.max(jnp.abs(ours.advantages))) > 0.5

  values = jnp.zeros((2, 6))
  lost_gae = gae(jnp.zeros(2), _MASK, values, token_rewards=reference_layout)
  np.testing.assert_array_equal(lost_gae.advantages, 0.0)
  ours_gae = gae(jnp.array([1.0, 0.0]), _MASK, values)
  # Zero critic, gamma = lam = 1: every trained token of the successful row returns 1.
  np.testing.assert_allclose(ours_gae.returns, [[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]])


def test_gae_worked_example_skips_observation_tokens():
  # Trained tokens 0 and 2, observation token 1 (its value 9.0 must not matter).
  # gamma 0.9, lam 0.5, outcome 1 on token 2:
  #   delta_2 = 1 + 0.9 * 0 - 0.8 = 0.2               A_2 = 0.2
  #   delta_0 = 0 + 0.9 * 0.8 - 0.5 = 0.22            A_0 = 0.22 + 0.45 * 0.2 = 0.31
  #   returns = A + V = [0.81, 1.0]; whitened [0.31, 0.2] -> [1, -1].
  values = jnp.array([[0.5, 9.0, 0.8]])
  mask = jnp.array([[1.0, 0.0, 1.0]])
  out = gae(jnp.array([1.0]), mask, values, gamma=0.9, lam=0.5)
  np.testing.assert_allclose(out.returns, [[0.81, 0.0, 1.0]], atol=1e-6)
  np.testing.assert_allclose(out.advantages, [[1.0, 0.0, -1.0]], atol=1e-4)


def _reference_gae(rewards, mask, values, gamma, lam):
  """Textbook GAE loop run on each row's trained tokens, scattered back (0 elsewhere)."""
  advantages = np.zeros_like(values)
  for row in range(values.shape[0]):
    (positions,) = np.nonzero(mask[row])
    step_values = values[row, positions]
    step_rewards = np.zeros(len(positions))
    if len(positions):
      step_rewards[-1] = rewards[row]
    running = 0.0
    for k in reversed(range(len(positions))):
      next_value = step_values[k + 1] if k + 1 < len(positions) else 0.0
      delta = step_rewards[k] + gamma * next_value - step_values[k]
      running = delta + gamma * lam * running
      advantages[row, positions[k]] = running
  return advantages


def test_gae_matches_textbook_loop_on_random_multi_turn_masks():
  rng = np.random.default_rng(1)
  batch, length = 5, 17
  mask = (rng.random((batch, length)) < 0.6).astype(np.float32)
  mask[3] = 0.0  # an all-padding row
  values = rng.normal(size=(batch, length)).astype(np.float32)
  rewards = rng.random(batch).astype(np.float32)
  out = gae(jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(values), gamma=0.95, lam=0.9)
  raw = _reference_gae(rewards, mask, values, 0.95, 0.9)
  trained = mask.astype(bool)
  np.testing.assert_allclose(out.returns, np.where(trained, raw + values, 0.0), atol=1e-5)
  expected = np.zeros_like(raw)
  expected[trained] = _whiten(raw[trained])
  np.testing.assert_allclose(out.advantages, expected, atol=1e-4)


def test_gae_with_full_mask_is_plain_gae():
  # Single-turn case, every token trained: lam = 1 gives the Monte-Carlo advantage
  # R * gamma^(T-1-t) - V_t. T = 3, gamma 0.5, R = 1, V = [0.1, 0.2, 0.3]:
  # raw = [0.25 - 0.1, 0.5 - 0.2, 1 - 0.3] = [0.15, 0.3, 0.7]; returns = [0.25, 0.5, 1].
  out = gae(jnp.array([1.0]), jnp.ones((1, 3)), jnp.array([[0.1, 0.2, 0.3]]), gamma=0.5, lam=1.0)
  np.testing.assert_allclose(out.returns, [[0.25, 0.5, 1.0]], atol=1e-6)
  np.testing.assert_allclose(out.advantages[0], _whiten([0.15, 0.3, 0.7]), atol=1e-5)


def test_registry_estimators_jit_and_agree_with_direct_calls():
  rewards = jnp.array([1.0, 0.0, 0.5, 0.5])
  group_ids = jnp.array([1, 0, 1, 0])
  mask = jnp.tile(_MASK, (2, 1))
  values = jnp.linspace(0.0, 1.0, 24).reshape(4, 6)

  @jax.jit
  def through_registry(rewards, mask, group_ids, values):

    def estimate(name, **inputs):
      return adv.get_advantage_estimator(name)(rewards, mask, **inputs).advantages

    return {
        "grpo": estimate("grpo", group_ids=group_ids, num_groups=2),
        "rloo": estimate("rloo", group_ids=group_ids, num_groups=2),
        "reinforce_plus_plus": estimate("reinforce_plus_plus", gamma=0.9),
        "gae": estimate("gae", values=values, gamma=0.9, lam=0.8),
    }

  registry = through_registry(rewards, mask, group_ids, values)
  np.testing.assert_allclose(registry["grpo"], grpo(rewards, mask, group_ids, num_groups=2))
  np.testing.assert_allclose(registry["rloo"], rloo(rewards, mask, group_ids, num_groups=2))
  np.testing.assert_allclose(registry["reinforce_plus_plus"],
                             reinforce_plus_plus(rewards, mask, gamma=0.9).advantages)
  np.testing.assert_allclose(registry["gae"],
                             gae(rewards, mask, values, gamma=0.9, lam=0.8).advantages, atol=1e-6)


def test_registry_dispatches_and_returns_outcome_for_group_estimators():
  rewards = jnp.array([1.0, 0.0])
  mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  out = adv.get_advantage_estimator("grpo")(rewards, mask, group_ids=jnp.array([0, 0]),
                                            num_groups=1, normalize_by_std=False)
  np.testing.assert_allclose(out.advantages, [[0.5, 0.5, 0], [-0.5, 0, 0]])
  np.testing.assert_allclose(out.returns, [[1, 1, 0], [0, 0, 0]])
  assert set(adv.ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce_plus_plus", "gae", "gigpo"}


def test_registry_errors_are_clear():
  with pytest.raises(ValueError, match="'gae', 'gigpo', 'grpo', 'reinforce_plus_plus', 'rloo'"):
    adv.get_advantage_estimator("ppo")
  mask = jnp.ones((2, 2))
  with pytest.raises(ValueError, match="'grpo' needs `group_ids`"):
    adv.get_advantage_estimator("grpo")(jnp.zeros(2), mask, num_groups=1)
  with pytest.raises(ValueError, match="'rloo' does not use `token_rewards`"):
    adv.get_advantage_estimator("rloo")(jnp.zeros(2), mask, group_ids=jnp.zeros(2, jnp.int32),
                                        num_groups=1, token_rewards=mask)
  with pytest.raises(ValueError, match="'gae' needs `values`"):
    adv.get_advantage_estimator("gae")(jnp.zeros(2), mask)


def test_grpo_unbiased_std_is_torch_std_and_scales_by_the_bessel_factor():
  # Group [1, 0, 0, 1]: mean 0.5, population std 0.5, torch.std (Bessel) 0.5 sqrt(4/3) = 0.57735,
  # so A = +-0.5 / 0.57735 = +-0.866025 = +-1 x sqrt(3/4). A second group [2, 0]: mean 1,
  # population std 1, unbiased sqrt(2): A = +-1 / sqrt(2) = +-0.707107.
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 0.0])
  groups = jnp.array([0, 0, 0, 0, 1, 1])
  mask = jnp.ones((6, 1))
  unbiased = grpo(rewards, mask, groups, num_groups=2, std="unbiased", eps=0.0)[:, 0]
  population = grpo(rewards, mask, groups, num_groups=2, eps=0.0)[:, 0]
  expected = [0.866025, -0.866025, -0.866025, 0.866025, 0.707107, -0.707107]
  np.testing.assert_allclose(unbiased, expected, rtol=1e-5)
  np.testing.assert_allclose(population, [1, -1, -1, 1, 1, -1], rtol=1e-6)
  with pytest.raises(ValueError, match="std='sample' is not 'population' or 'unbiased'"):
    grpo(rewards, mask, groups, num_groups=2, std="sample")
