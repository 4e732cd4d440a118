"""Rollout correction: the sampler's probabilities are not the learner's, and what to do about it.

The sampler (a KV cache, bf16 matmuls, other kernels) and the learner's forward pass give the
same tokens slightly different probabilities. With pi_sampler the distribution the sampler drew
a token from (rollout.py records its log-prob, Batch.sampler_logprobs) and pi_old the learner's
before the update (learner.compute_experience), the per-token ratio

  rho_t = pi_old(y_t) / pi_sampler(y_t),      log rho_t = logp_old_t - logp_sampler_t

is the importance weight from the sampling distribution to the learner's (decoupled PPO: the
PPO ratio pi / pi_old bounds the update, rho corrects for who sampled). With a cap C > 1:

  "none"            w_t = 1
  "decoupled"       w_t = rho_t                            decoupled PPO's weight, untruncated
  "token_tis"       w_t = min(rho_t, C)                    truncated importance sampling
  "sequence_mask"   drop trajectory i unless 1/C <= prod_t rho_t <= C
  "geometric_mask"  drop trajectory i unless 1/C <= exp(mean_t log rho_t) <= C

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL, Fu
et al. 2025, for asynchronous RL) weighs each token by rho_t whole, the correction for episodes
played by an older policy (rollout.max_staleness): there pi_sampler is that policy and rho_t
carries the updates since, not rounding alone. The weight (decoupled or TIS)
multiplies each token's policy-gradient loss; a dropped trajectory leaves every
term of the loss (its tokens count in no aggregation), while the advantages, computed before,
keep its reward in its group's baseline. Products and means run over the trajectory's trained
tokens. The geometric mean is a per-token scale, so a useful cap for it is much nearer 1 than
for the product. Log-ratios are bounded to +-20 before exp(), like the policy losses'.

Mismatch metrics (always computed, whatever the correction): over trained tokens, the mean
log-ratio and the k3 estimate of KL(sampler || learner),

  KL = E_sampler[rho - 1 - log rho]  >= 0,

overall and by turn index (the k-th assistant reply of a trajectory): long multi-turn episodes
whose later turns drift show it there first.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from agentgym_jax.rl import masked

Metrics = dict[str, jax.Array]

CORRECTIONS = ("none", "decoupled", "token_tis", "sequence_mask", "geometric_mask")
_MAX_LOG_RATIO = 20.0


class Correction(NamedTuple):
  weights: jax.Array  # f32[B, T]: w_t, multiplying each token's policy-gradient loss
  kept: jax.Array  # f32[B]: 1 for a trajectory that stays in the loss, 0 for one dropped


def _log_ratio(old_logprobs: jax.Array, sampler_logprobs: jax.Array) -> jax.Array:
  log_ratio = old_logprobs.astype(jnp.float32) - sampler_logprobs.astype(jnp.float32)
  return jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _k3(log_ratio: jax.Array) -> jax.Array:
  # rho - 1 - log rho, with expm1 so that small log-ratios (1e-4 and below) do not cancel.
  return jnp.expm1(log_ratio) - log_ratio


def rollout_correction(old_logprobs: jax.Array, sampler_logprobs: jax.Array, loss_mask: jax.Array,
                       *, method: str = "none", cap: float = 2.0) -> tuple[Correction, Metrics]:
  """The correction `method` (one of CORRECTIONS) with cap C, as the module docstring defines.

  Args:
    old_logprobs: f32[B, T] the learner's log-probs of the sampled tokens before the update.
    sampler_logprobs: f32[B, T] the sampler's log-probs of the same tokens.
    loss_mask: [B, T] trained tokens.
    method: one of CORRECTIONS.
    cap: C > 1.

  Returns:
    (Correction(weights, kept), metrics). Metrics: decoupled and token_tis give
    rollout_correction/weight_mean (of w over trained tokens), token_tis also
    rollout_correction/truncated_fraction (trained tokens with rho > C); the masks give
    rollout_correction/dropped_fraction (of the trajectories with trained tokens); none gives
    none.
  """
  if method not in CORRECTIONS:
    raise ValueError(f"Unknown rollout correction {method!r}; expected one of {CORRECTIONS}.")
  if cap <= 1:
    raise ValueError(f"The rollout correction cap must be > 1, got {cap}.")
  log_ratio = _log_ratio(old_logprobs, sampler_logprobs)
  trained = loss_mask.astype(bool)
  weights = jnp.ones_like(log_ratio)
  kept = jnp.ones(log_ratio.shape[0], jnp.float32)
  metrics: Metrics = {}
  if method == "decoupled":
    weights = jnp.where(trained, jnp.exp(log_ratio), 1.0)
    metrics["rollout_correction/weight_mean"] = masked.masked_mean(weights, loss_mask)
  elif method == "token_tis":
    weights = jnp.where(trained, jnp.minimum(jnp.exp(log_ratio), cap), 1.0)
    metrics["rollout_correction/weight_mean"] = masked.masked_mean(weights, loss_mask)
    metrics["rollout_correction/truncated_fraction"] = masked.masked_mean(
        (log_ratio > jnp.log(cap)).astype(jnp.float32), loss_mask)
  elif method in ("sequence_mask", "geometric_mask"):
    if method == "sequence_mask":
      sequence_log_ratio = masked.masked_sum(log_ratio, loss_mask, axis=1)
    else:
      sequence_log_ratio = masked.masked_mean(log_ratio, loss_mask, axis=1)
    # 1/C <= exp(x) <= C  <=>  |x| <= log C.
    kept = (jnp.abs(sequence_log_ratio) <= jnp.log(cap)).astype(jnp.float32)
    has_tokens = jnp.any(trained, axis=1)
    metrics["rollout_correction/dropped_fraction"] = masked.masked_mean(1.0 - kept, has_tokens)
  return Correction(weights, kept), metrics


def turn_indices(loss_mask: jax.Array) -> jax.Array:
  """The turn of every trained token: int32[B, T], 0 on the first assistant reply's tokens, 1
  on the second's, ..., and -1 on untrained tokens.

  A reply is a run of trained tokens; runs are separated by the untrained observation turns
  between them, so the k-th run of a row is its k-th reply.
  """
  trained = loss_mask.astype(bool)
  previous = jnp.pad(trained[:, :-1], ((0, 0), (1, 0)))
  starts = trained & ~previous
  return jnp.where(trained, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, -1)


def mismatch_metrics(old_logprobs: jax.Array, sampler_logprobs: jax.Array, loss_mask: jax.Array, *,
                     num_turns: int = 0) -> Metrics:
  """How far the sampler is from the learner, over trained tokens:

    mismatch/log_ratio               mean of log rho_t
    mismatch/kl                      mean of rho_t - 1 - log rho_t, i.e. KL(sampler || learner)
    mismatch/turn_K/log_ratio, /kl   the same over the tokens of the K-th reply (K = 1 ..
                                     num_turns, zero-padded; 0 for a turn no trajectory reached)

  `num_turns` is static: the metrics' keys are the same every step.
  """
  log_ratio = _log_ratio(old_logprobs, sampler_logprobs)
  kl = _k3(log_ratio)
  metrics = {
      "mismatch/log_ratio": masked.masked_mean(log_ratio, loss_mask),
      "mismatch/kl": masked.masked_mean(kl, loss_mask)
  }
  if num_turns <= 0:
    return metrics
  turns = turn_indices(loss_mask)
  # Tokens of untrained positions and of turns past num_turns go to a discarded last segment.
  segments = jnp.where((turns >= 0) & (turns < num_turns), turns, num_turns).ravel()

  def per_turn(values: jax.Array) -> jax.Array:
    return jax.ops.segment_sum(values.ravel(), segments, num_segments=num_turns + 1)[:-1]

  counts = jnp.maximum(per_turn(jnp.ones_like(log_ratio)), 1.0)
  turn_log_ratio, turn_kl = per_turn(log_ratio) / counts, per_turn(kl) / counts
  width = len(str(num_turns))
  for turn in range(num_turns):
    metrics[f"mismatch/turn_{turn + 1:0{width}d}/log_ratio"] = turn_log_ratio[turn]
    metrics[f"mismatch/turn_{turn + 1:0{width}d}/kl"] = turn_kl[turn]
  return metrics
