"""Rollout correction and mismatch metrics: worked values, then a deliberately mismatched sampler
(perturbed weights) against the learner, where weights, masks and per-turn metrics must be what
the equations say, and the update must see them."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny
import tolerances
from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import learner, rl, rollout
from agentgym_jax.models import load_model
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool
from rl_helpers import check_config

rollout_correction = jax.jit(rl.rollout_correction, static_argnames=("method", "cap"))
mismatch_metrics = jax.jit(rl.mismatch_metrics, static_argnames=("num_turns",))

# Sequences of per-token ratios rho = pi_old / pi_sampler (the last row has no trained token):
#   row 0: [1.5, 1.5]  product 2.25, geometric mean 1.5
#   row 1: [1.5, 0.9]  product 1.35, geometric mean 1.162
#   row 2: [0.5, 0.9]  product 0.45, geometric mean 0.671
#   row 3: untrained
_RATIOS = np.array([[1.5, 1.5], [1.5, 0.9], [0.5, 0.9], [3.0, 3.0]], np.float32)
_SAMPLER = jnp.full((4, 2), -2.0)
_OLD = _SAMPLER + jnp.log(_RATIOS)
_MASK = jnp.array([[1, 1], [1, 1], [1, 1], [0, 0]], jnp.float32)


def test_token_tis_truncates_each_ratio_at_the_cap():
  # w = min(rho, 2): [1.5, 1.5, 1.5, 0.9, 0.5, 0.9] on trained tokens, 1 elsewhere; no token's
  # ratio exceeds 2; the mean of w is 6.8 / 6.
  correction, metrics = rollout_correction(_OLD, _SAMPLER, _MASK, method="token_tis", cap=2.0)
  np.testing.assert_allclose(correction.weights, [[1.5, 1.5], [1.5, 0.9], [0.5, 0.9], [1.0, 1.0]],
                             rtol=1e-6)
  np.testing.assert_array_equal(correction.kept, 1.0)
  assert float(metrics["rollout_correction/weight_mean"]) == pytest.approx(6.8 / 6, rel=1e-6)
  assert float(metrics["rollout_correction/truncated_fraction"]) == 0.0
  # Cap 1.2: the three 1.5s become 1.2, half the trained tokens are truncated.
  correction, metrics = rollout_correction(_OLD, _SAMPLER, _MASK, method="token_tis", cap=1.2)
  np.testing.assert_allclose(correction.weights[:3], [[1.2, 1.2], [1.2, 0.9], [0.5, 0.9]],
                             rtol=1e-6)
  assert float(metrics["rollout_correction/truncated_fraction"]) == pytest.approx(0.5)


def test_decoupled_weights_each_token_by_its_whole_ratio():
  # w = rho on trained tokens, whatever the cap (an untrained row keeps 1, not its 3.0): decoupled
  # PPO's behaviour-to-proximal weight; the mean of w is 6.8 / 6, none dropped.
  for cap in (1.2, 2.0):
    correction, metrics = rollout_correction(_OLD, _SAMPLER, _MASK, method="decoupled", cap=cap)
    np.testing.assert_allclose(correction.weights,
                               [[1.5, 1.5], [1.5, 0.9], [0.5, 0.9], [1.0, 1.0]], rtol=1e-6)
    np.testing.assert_array_equal(correction.kept, 1.0)
    assert float(metrics["rollout_correction/weight_mean"]) == pytest.approx(6.8 / 6, rel=1e-6)
    assert "rollout_correction/truncated_fraction" not in metrics


def test_sequence_mask_drops_trajectories_whose_product_leaves_the_cap():
  # Cap 2: keep 1/2 <= product <= 2: row 0 (2.25) and row 2 (0.45) go, row 1 (1.35) stays; the
  # untrained row 3 (an empty product, 1) stays and is not counted: 2 of 3 dropped.
  correction, metrics = rollout_correction(_OLD, _SAMPLER, _MASK, method="sequence_mask", cap=2.0)
  np.testing.assert_array_equal(correction.kept, [0.0, 1.0, 0.0, 1.0])
  np.testing.assert_array_equal(correction.weights, 1.0)
  assert float(metrics["rollout_correction/dropped_fraction"]) == pytest.approx(2 / 3)


def test_geometric_mask_uses_the_per_token_geometric_mean():
  # Cap 2: geometric means 1.5, 1.162, 0.671 are all inside [0.5, 2]: nothing dropped, where the
  # product dropped two. Cap 1.3: row 0 (1.5 > 1.3) and row 2 (0.671 < 0.769) go.
  correction, metrics = rollout_correction(_OLD, _SAMPLER, _MASK, method="geometric_mask", cap=2.0)
  np.testing.assert_array_equal(correction.kept, 1.0)
  assert float(metrics["rollout_correction/dropped_fraction"]) == 0.0
  correction, _ = rollout_correction(_OLD, _SAMPLER, _MASK, method="geometric_mask", cap=1.3)
  np.testing.assert_array_equal(correction.kept, [0.0, 1.0, 0.0, 1.0])


def test_no_correction_changes_nothing_and_bad_settings_are_refused():
  correction, metrics = rollout_correction(_OLD, _SAMPLER, _MASK, method="none", cap=2.0)
  np.testing.assert_array_equal(correction.weights, 1.0)
  np.testing.assert_array_equal(correction.kept, 1.0)
  assert metrics == {}
  with pytest.raises(ValueError, match="Unknown rollout correction 'tis'"):
    rl.rollout_correction(_OLD, _SAMPLER, _MASK, method="tis")
  with pytest.raises(ValueError, match="cap must be > 1, got 1.0"):
    rl.rollout_correction(_OLD, _SAMPLER, _MASK, method="token_tis", cap=1.0)


def test_turn_indices_count_runs_of_trained_tokens():
  mask = jnp.array([[0, 1, 1, 0, 0, 1, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(
      rl.turn_indices(mask), [[-1, 0, 0, -1, -1, 1, -1, 2, 2], [0, -1, -1, -1, -1, -1, -1, -1, -1]])


def test_mismatch_metrics_by_turn_worked_values():
  # Log-ratios log rho on trained tokens:
  #   row 0: turn 1 [0.1, -0.1], turn 2 [0.2]
  #   row 1: turn 1 [0.4]
  # mean log-ratio: turn 1 (0.1 - 0.1 + 0.4) / 3 = 0.1333, turn 2 0.2, turn 3 (none) 0.
  # KL = mean(rho - 1 - log rho): k(x) = e^x - 1 - x.
  log_ratio = jnp.array([[0.0, 0.1, -0.1, 9.0, 0.2], [0.0, 0.4, 0.0, 0.0, 0.0]])
  mask = jnp.array([[0, 1, 1, 0, 1], [0, 1, 0, 0, 0]], jnp.float32)
  metrics = mismatch_metrics(log_ratio, jnp.zeros_like(log_ratio), mask, num_turns=3)
  k = lambda x: math.exp(x) - 1 - x
  assert float(metrics["mismatch/log_ratio"]) == pytest.approx(0.6 / 4, rel=1e-6)
  assert float(metrics["mismatch/kl"]) == pytest.approx((k(0.1) + k(-0.1) + k(0.2) + k(0.4)) / 4,
                                                        rel=1e-5)
  assert float(metrics["mismatch/turn_1/log_ratio"]) == pytest.approx(0.4 / 3, rel=1e-6)
  assert float(metrics["mismatch/turn_1/kl"]) == pytest.approx((k(0.1) + k(-0.1) + k(0.4)) / 3,
                                                               rel=1e-5)
  assert float(metrics["mismatch/turn_2/log_ratio"]) == pytest.approx(0.2, rel=1e-6)
  assert float(metrics["mismatch/turn_2/kl"]) == pytest.approx(k(0.2), rel=1e-5)
  assert float(metrics["mismatch/turn_3/log_ratio"]) == 0.0
  # Keys are zero-padded to the widest turn number, so they sort in turn order.
  wide = mismatch_metrics(log_ratio, jnp.zeros_like(log_ratio), mask, num_turns=12)
  assert "mismatch/turn_02/kl" in wide and "mismatch/turn_12/kl" in wide
  # Turns past num_turns are left out of the per-turn metrics, not folded into the last one.
  short = mismatch_metrics(log_ratio, jnp.zeros_like(log_ratio), mask, num_turns=1)
  assert float(short["mismatch/turn_1/log_ratio"]) == pytest.approx(0.4 / 3, rel=1e-6)
  assert "mismatch/turn_2/log_ratio" not in short


# --- a deliberately mismatched sampler --------------------------------------------------------

_TURNS = 3
_ROWS = 32


@pytest.fixture(scope="module")
def played(tmp_path_factory):
  """The learner's policy (the tiny model in f32, its logits sharpened 6x through the final
  norm so that probabilities differ enough between tokens for ratios to pass a cap of 2), and
  one batch of 3-turn echo episodes played by it and one played by a perturbed copy of it
  (every weight plus 30% of its tensor's std in Gaussian noise)."""
  checkpoint = tiny.make_checkpoint(tmp_path_factory.mktemp("tiny"))
  model, tokenizer = load_model(str(checkpoint), dtype=jnp.float32)
  model.final_norm.value = 6.0 * model.final_norm.value
  graphdef, params = nnx.split(model)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  perturbed = jax.tree.unflatten(treedef, [
      x + 0.3 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if x.ndim else x
      for x, k in zip(leaves, keys)
  ])
  sampler = Sampler(model, cache_slots=96, max_batch=_ROWS)
  tasks = [
      (task, group) for group, task in enumerate(range(100, 100 + _ROWS // 4)) for _ in range(4)
  ]
  batches = {}
  with EnvPool("echo", _ROWS, options={"turns": _TURNS}) as pool:
    for name, sampler_params in (("same", params), ("perturbed", perturbed)):
      player = rollout.Player(sampler, sampler_params, pool, tokenizer.chat,
                              rollout.TurnSampling(max_new_tokens=2), max_context=96)
      trajectories, _ = rollout.collect(player, tasks, horizon=_TURNS, key=jax.random.key(0))
      batches[name] = (trajectories, rollout.pack(trajectories))
  return graphdef, params, batches


def _experience(graphdef, params, batch, method, cap=2.0):
  loss = learner.LossConfig(rollout_correction=method, rollout_correction_cap=cap, logprob_chunk=64)
  return learner.compute_experience(learner.Networks(graphdef), (params, None), None, batch,
                                    loss=loss, num_groups=2 * _ROWS, num_turns=_TURNS)


def _turn_of_each_target(trajectories, length):
  """Turn number (1, 2, ...) of every target token, 0 on untrained ones, from the trajectories'
  own loss masks: each run of generated tokens is one reply."""
  turns = np.zeros((len(trajectories), length), np.int64)
  for row, t in enumerate(trajectories):
    reply = 0
    for position in range(1, len(t.loss_mask)):
      if t.loss_mask[position] and not t.loss_mask[position - 1]:
        reply += 1
      if t.loss_mask[position]:
        turns[row, position - 1] = reply
  return turns


@pytest.mark.slow
def test_an_identical_sampler_shows_no_mismatch(played):
  graphdef, params, batches = played
  _, batch = batches["same"]
  experience, metrics = _experience(graphdef, params, batch, "token_tis")
  mask = np.asarray(batch.loss_mask[:, 1:], bool)
  log_ratio = np.asarray(experience.old_logprobs - batch.sampler_logprobs[:, 1:])[mask]
  # The sampler's cached decode and the learner's full forward differ by summation order only
  # (tests/tolerances.py: 2 layers, widest dot 128; the sharpened logits are within +-8).
  tolerance = tolerances.reordered_logprobs(num_layers=2, widest_dot=128, logit_scale=8.0)
  assert np.abs(log_ratio).max() <= tolerance
  np.testing.assert_allclose(np.asarray(experience.rollout_weights)[mask], 1.0, atol=2 * tolerance)
  assert abs(float(metrics["mismatch/log_ratio"])) <= tolerance
  assert float(metrics["rollout_correction/truncated_fraction"]) == 0.0


def test_a_perturbed_sampler_gets_the_weights_masks_and_metrics_of_the_equations(played):
  graphdef, params, batches = played
  trajectories, batch = batches["perturbed"]
  experience, metrics = _experience(graphdef, params, batch, "token_tis")
  old = np.asarray(experience.old_logprobs, np.float64)
  # The learner's log-probs are those of the unperturbed policy, not the sampler's.
  reference, _, _ = learner.token_logprobs(graphdef, params, batch, learner.LossConfig())
  np.testing.assert_allclose(old, reference, atol=1e-5)
  sampler = np.asarray(batch.sampler_logprobs[:, 1:], np.float64)
  mask = np.asarray(batch.loss_mask[:, 1:], bool)
  log_ratio = np.where(mask, old - sampler, 0.0)
  rho = np.exp(log_ratio)
  # A real mismatch: the k3 KL(sampler || learner) is far above float noise, and some tokens'
  # ratios pass the cap of 2.
  kl = rho - 1 - log_ratio
  assert kl[mask].mean() > 1e-2
  assert (rho[mask] > 2.0).any() and (rho[mask] <= 2.0).any()
  # token_tis: w = min(rho, 2) on trained tokens (f32 exp of an f32 log-ratio: 1e-6 relative).
  np.testing.assert_allclose(
      np.asarray(experience.rollout_weights)[mask],
      np.minimum(rho, 2.0)[mask], rtol=1e-5)
  assert float(metrics["rollout_correction/truncated_fraction"]) == pytest.approx(
      (rho[mask] > 2.0).mean(), abs=1e-6)
  # Mismatch metrics, overall and for each of the 3 turns, from the trajectories' replies.
  assert float(metrics["mismatch/log_ratio"]) == pytest.approx(log_ratio[mask].mean(), abs=1e-5)
  assert float(metrics["mismatch/kl"]) == pytest.approx(kl[mask].mean(), rel=1e-4)
  turns = _turn_of_each_target(trajectories, mask.shape[1])
  assert (turns[mask] > 0).all() and (turns == 2).any()
  for turn in range(1, _TURNS + 1):
    on_turn = turns == turn
    expected = (log_ratio[on_turn].mean(), kl[on_turn].mean()) if on_turn.any() else (0, 0)
    assert float(metrics[f"mismatch/turn_{turn}/log_ratio"]) == pytest.approx(expected[0], abs=1e-5)
    assert float(metrics[f"mismatch/turn_{turn}/kl"]) == pytest.approx(expected[1], rel=1e-4)
  # sequence_mask keeps the trajectories whose product of ratios is within [1/2, 2]; with a
  # mismatch this large some go, some stay.
  experience, metrics = _experience(graphdef, params, batch, "sequence_mask")
  expected_kept = np.abs(log_ratio.sum(axis=1)) <= math.log(2.0)
  np.testing.assert_array_equal(np.asarray(experience.kept), expected_kept)
  trained_rows = mask.any(axis=1)
  assert 0 < expected_kept[trained_rows].sum() < trained_rows.sum()
  assert float(metrics["rollout_correction/dropped_fraction"]) == pytest.approx(
      1 - expected_kept[trained_rows].mean(), abs=1e-6)
  # geometric_mask with the same cap is far more lenient: a per-token mean against 2.
  experience, _ = _experience(graphdef, params, batch, "geometric_mask", cap=2.0)
  geometric = np.abs(log_ratio.sum(axis=1) / np.maximum(mask.sum(axis=1), 1)) <= math.log(2.0)
  np.testing.assert_array_equal(np.asarray(experience.kept), geometric)
  assert geometric.sum() >= expected_kept.sum()


def test_the_update_trains_only_kept_trajectories_with_their_weights(played):
  graphdef, params, batches = played
  _, batch = batches["perturbed"]
  loss = learner.LossConfig(kl_coef=0.0, entropy_coef=0.0, logprob_chunk=64)
  experience, _ = _experience(graphdef, params, batch, "token_tis")
  experience = experience.replace(advantages=jnp.where(batch.loss_mask[:, 1:] > 0, 1.0, 0.0))

  def policy_loss(experience):
    return learner._loss_fn((params, None), learner.Networks(graphdef), batch, experience,
                            loss)[1]["policy/loss"]

  # Old log-probs are the learner's own, so every PPO ratio is 1 and the unweighted loss is
  # -mean(A) = -1; with the TIS weights it is -mean(w) over trained tokens.
  unweighted = experience.replace(rollout_weights=jnp.ones_like(experience.rollout_weights))
  assert float(policy_loss(unweighted)) == pytest.approx(-1.0, abs=1e-6)
  mask = np.asarray(batch.loss_mask[:, 1:], bool)
  expected = -np.asarray(experience.rollout_weights)[mask].mean()
  assert float(policy_loss(experience)) == pytest.approx(expected, rel=1e-5)
  # Dropping every trajectory but row 0 leaves row 0's tokens alone in the token mean.
  kept = jnp.zeros_like(experience.kept).at[0].set(1.0)
  only_first = experience.replace(kept=kept)
  expected = -np.asarray(experience.rollout_weights)[0][mask[0]].mean()
  assert float(policy_loss(only_first)) == pytest.approx(expected, rel=1e-5)


def test_rollout_correction_keys_are_validated_at_start_up():
  c = config_lib.base_config()
  c.algorithm.rollout_correction = "token_tis"
  settings_lib.Settings.from_config(c)
  c.algorithm.rollout_correction = "tis"
  check_config(c, r"algorithm.rollout_correction='tis' is not one of \['auto', 'none', ")
  c.algorithm.rollout_correction = "sequence_mask"
  c.algorithm.rollout_correction_cap = 0.5
  check_config(c, r"algorithm.rollout_correction_cap=0.5 must be > 1")
