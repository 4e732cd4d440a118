"""Advantage estimators for multi-turn trajectories: GRPO, RLOO, REINFORCE++ and GAE.

All functions are pure, jittable and work on a batch of right-padded token arrays:

  rewards:       f32[B]     outcome reward of each trajectory (1 success / 0 failure, or a score)
  loss_mask:     f32[B, T]  1 exactly on sampler-generated assistant tokens (incl. turn-end)
  group_ids:     int[B]     samples of one task share an id in [0, num_groups)
  values:        f32[B, T]  critic value at each token (GAE only)
  token_rewards: f32[B, T]  optional extra per-token rewards, e.g. a KL penalty

`num_groups` and `normalize_by_std` are static under jit; gamma, lam and eps may be traced.
Every returned advantage is 0 on untrained tokens. A trajectory alternates assistant turns
(trained) with observation turns (untrained), so the trained tokens of a row are not contiguous.
The token-level estimators (REINFORCE++, GAE) run over the *trained-token subsequence* of each
row: observation tokens are transparent, they neither discount nor cut the return, and the
environment's reply between two turns acts as the transition between the last token of one turn
and the first token of the next. Rewards written on untrained positions are ignored, which is
why `place_on_last_trained_token` exists: the reference implementation writes the outcome on the
final response token, an observation token with loss_mask 0, so GAE and REINFORCE++ lose it.

`ADVANTAGE_ESTIMATORS` maps config names to estimators with one calling convention:

  advantages, returns = estimator(rewards, loss_mask, *, group_ids=..., num_groups=...,
                                  values=..., token_rewards=..., **hyperparameters)

where `returns` is the regression target for a critic (GAE) or the per-token return.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from agentgym_jax.rl import masked
from agentgym_jax.rl import registry


class Advantages(NamedTuple):
  advantages: jax.Array  # f32[B, T], 0 on untrained tokens
  returns: jax.Array  # f32[B, T], 0 on untrained tokens


def place_on_last_trained_token(rewards: jax.Array, loss_mask: jax.Array) -> jax.Array:
  """Puts each trajectory's outcome reward on its last trained token.

  Args:
    rewards: f32[B] outcome reward per trajectory.
    loss_mask: [B, T] trained-token mask.

  Returns:
    f32[B, T] zeros except `rewards[b]` at the last position of row b with loss_mask 1. A row
    with no trained token gets no reward (there is nothing to credit).
  """
  num_tokens = loss_mask.shape[1]
  positions = jnp.arange(num_tokens)
  last_trained = jnp.max(jnp.where(loss_mask.astype(bool), positions, -1), axis=1)
  # one_hot of -1 is all zeros, which handles rows without trained tokens.
  return jax.nn.one_hot(last_trained, num_tokens, dtype=jnp.float32) * rewards[:, None]


def group_mean_and_std(rewards: jax.Array, group_ids: jax.Array,
                       num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-trajectory statistics of the trajectory's group, by segment sums over `group_ids`.

  Groups may appear in any order and have any sizes; `num_groups` is static so shapes are.

  Args:
    rewards: f32[B].
    group_ids: int[B] with values in [0, num_groups).
    num_groups: static number of segments.

  Returns:
    (mean, std, size), each [B]: the mean, population standard deviation and size of the group
    that trajectory b belongs to.
  """
  rewards = rewards.astype(jnp.float32)
  size = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_segments=num_groups)
  mean = jax.ops.segment_sum(rewards, group_ids, num_segments=num_groups) / jnp.maximum(size, 1)
  # Two passes (sum of squared deviations) rather than E[r^2] - E[r]^2, which cancels badly
  # for large scores such as SciWorld's 0-100.
  deviation = rewards - mean[group_ids]
  variance = jax.ops.segment_sum(jnp.square(deviation), group_ids,
                                 num_segments=num_groups) / jnp.maximum(size, 1)
  return mean[group_ids], jnp.sqrt(variance[group_ids]), size[group_ids]


def grpo_advantages(
    rewards: jax.Array,
    loss_mask: jax.Array,
    group_ids: jax.Array,
    *,
    num_groups: int,
    normalize_by_std: bool = True,
    std: str = "population",
    eps: float = 1e-6,
) -> jax.Array:
  """Group-relative advantage (GRPO), broadcast over the trajectory's trained tokens.

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)    if normalize_by_std
    A_i =  r_i - mean_g(r)                        otherwise ("Dr. GRPO": no std scaling, which
                                                  would up-weight near-uniform groups)

  with the mean and std over the group g of trajectory i. `std` is "population" (the default:
  [1, 0, 0, 1] -> [1, -1, -1, 1]) or "unbiased", Bessel-corrected as torch.std is in verl, TRL
  and AgentGym-RL: the population std times sqrt(n / (n - 1)) for a group of n, so their
  advantages are those of "population" times sqrt((n - 1) / n) (up to eps). A group of size 1,
  or whose rewards are all equal, gets A = 0 (its numerator is exactly 0).

  Returns:
    f32[B, T] advantages, A_i on row i's trained tokens and 0 elsewhere.
  """
  if std not in ("population", "unbiased"):
    raise ValueError(f"std={std!r} is not 'population' or 'unbiased'")
  mean, spread, size = group_mean_and_std(rewards, group_ids, num_groups)
  if std == "unbiased":
    spread = spread * jnp.sqrt(size / jnp.maximum(size - 1, 1))
  centred = rewards - mean
  scores = centred / (spread + eps) if normalize_by_std else centred
  return scores[:, None] * loss_mask.astype(jnp.float32)


def rloo_advantages(rewards: jax.Array, loss_mask: jax.Array, group_ids: jax.Array, *,
                    num_groups: int) -> jax.Array:
  """REINFORCE leave-one-out: each sample's baseline is the mean of the others in its group.

    A_i = r_i - (1 / (n_g - 1)) sum_{j in g, j != i} r_j  =  n_g / (n_g - 1) (r_i - mean_g(r))

  A group of size 1 has no other sample and gets A = 0.

  There is no eps (and no algorithm.rloo_eps, unlike algorithm.grpo_eps): the one division is by
  n_g - 1, a count that is >= 1 for every group scored, where GRPO's divides by a std that is 0
  for a group of equal rewards. verl's RLOO takes an epsilon argument it never uses.

  Returns:
    f32[B, T] advantages, A_i on row i's trained tokens and 0 elsewhere.
  """
  mean, _, size = group_mean_and_std(rewards, group_ids, num_groups)
  scores = jnp.where(size > 1, size / jnp.maximum(size - 1, 1) * (rewards - mean), 0.0)
  return scores[:, None] * loss_mask.astype(jnp.float32)


def _discounted_returns(token_rewards: jax.Array, loss_mask: jax.Array, gamma: float) -> jax.Array:
  """G_t = r_t + gamma * G_next(t) over each row's trained-token subsequence (0 elsewhere)."""
  trained = loss_mask.astype(bool)

  def step(next_return, inputs):
    reward, is_trained = inputs
    current = reward + gamma * next_return
    # An untrained token passes the running return through untouched.
    return jnp.where(is_trained, current, next_return), jnp.where(is_trained, current, 0.0)

  _, returns = jax.lax.scan(
      step,
      jnp.zeros(token_rewards.shape[0], jnp.float32),
      (token_rewards.T.astype(jnp.float32), trained.T),
      reverse=True,
  )
  return returns.T


def reinforce_plus_plus_advantages(
    rewards: jax.Array,
    loss_mask: jax.Array,
    *,
    token_rewards: jax.Array | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> Advantages:
  """REINFORCE++: discounted token-level returns, whitened over every trained token in the batch.

  Over the trained tokens t_1 < ... < t_K of a row:

    r_k = R * [k = K] + token_rewards[t_k]         (outcome R on the last trained token)
    G_k = r_k + gamma * G_{k+1},  G_{K+1} = 0
    A   = (G - mean(G)) / sqrt(var(G) + eps)       (masked mean/var over the whole batch)

  `token_rewards` on untrained positions are ignored.

  Returns:
    Advantages(advantages=A, returns=G), both f32[B, T] and 0 on untrained tokens.
  """
  step_rewards = place_on_last_trained_token(rewards, loss_mask)
  if token_rewards is not None:
    step_rewards = step_rewards + token_rewards
  returns = _discounted_returns(step_rewards, loss_mask, gamma)
  return Advantages(masked.masked_whiten(returns, loss_mask, eps), returns)


def gae_advantages(
    rewards: jax.Array,
    loss_mask: jax.Array,
    values: jax.Array,
    *,
    token_rewards: jax.Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-8,
) -> Advantages:
  """Generalised advantage estimation (PPO) over each row's trained-token subsequence.

  Over the trained tokens t_1 < ... < t_K of a row, with V_k = values[t_k]:

    r_k     = R * [k = K] + token_rewards[t_k]
    delta_k = r_k + gamma * V_{k+1} - V_k,        V_{K+1} = 0 (the episode ends)
    A_k     = delta_k + gamma * lam * A_{k+1},    A_{K+1} = 0
    R_k     = A_k + V_k                           (the critic's regression target)

  and the returned advantages are A whitened over all trained tokens of the batch; the returns
  are not whitened. Observation tokens are skipped: the value of the state after an
  environment reply is read at the next assistant token, where the policy acts again. Without
  `place_on_last_trained_token` the outcome would sit on an untrained token and every delta
  would miss it, which is the reference implementation's defect.

  Returns:
    Advantages(advantages, returns), both f32[B, T] and 0 on untrained tokens.
  """
  step_rewards = place_on_last_trained_token(rewards, loss_mask)
  if token_rewards is not None:
    step_rewards = step_rewards + token_rewards
  trained = loss_mask.astype(bool)

  def step(carry, inputs):
    next_value, next_advantage = carry
    reward, value, is_trained = inputs
    delta = reward + gamma * next_value - value
    advantage = delta + gamma * lam * next_advantage
    # Only trained tokens advance the recursion; observation tokens are transparent.
    carry = (
        jnp.where(is_trained, value, next_value),
        jnp.where(is_trained, advantage, next_advantage),
    )
    return carry, jnp.where(is_trained, advantage, 0.0)

  batch_size = rewards.shape[0]
  zeros = jnp.zeros(batch_size, jnp.float32)
  values = values.astype(jnp.float32)
  _, raw_advantages = jax.lax.scan(
      step,
      (zeros, zeros),
      (step_rewards.T.astype(jnp.float32), values.T, trained.T),
      reverse=True,
  )
  raw_advantages = raw_advantages.T
  returns = jnp.where(trained, raw_advantages + values, 0.0)
  return Advantages(masked.masked_whiten(raw_advantages, loss_mask, eps), returns)


# The registry: each entry declares what it reads, so the learner passes exactly that and the
# config knows which algorithm.* keys set its hyperparameters. A new estimator is one entry here.

_BATCH_INPUTS = ("group_ids", "num_groups", "values", "token_rewards")


def _outcome_returns(rewards: jax.Array, loss_mask: jax.Array) -> jax.Array:
  # Undiscounted return of every trained token is the trajectory's outcome.
  return rewards[:, None] * loss_mask.astype(jnp.float32)


def _with_outcome_returns(advantages_fn: Callable[..., jax.Array]) -> Callable[..., Advantages]:
  """A group estimator whose critic target is the outcome itself."""

  def estimate(rewards: jax.Array, loss_mask: jax.Array, **inputs) -> Advantages:
    return Advantages(
        advantages_fn(rewards, loss_mask, **inputs), _outcome_returns(rewards, loss_mask))

  return estimate


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
  """A registry entry, called as

    advantages, returns = estimator(rewards, loss_mask, **inputs, **hyperparameters)

  Attributes:
    name: the config name (algorithm.advantage).
    fn: the estimator; it receives the batch inputs it declares, by keyword.
    needs: batch inputs it cannot run without (group_ids and num_groups for a group baseline,
      values for a critic).
    accepts: optional batch inputs it uses (token_rewards, e.g. a KL penalty).
    hyperparameters: (argument, algorithm.* config key) pairs it reads.
  """

  name: str
  fn: Callable[..., Advantages]
  needs: tuple[str, ...] = ()
  accepts: tuple[str, ...] = ()
  hyperparameters: tuple[tuple[str, str], ...] = ()

  @property
  def needs_groups(self) -> bool:
    return "group_ids" in self.needs

  @property
  def needs_values(self) -> bool:
    return "values" in self.needs

  def __call__(self, rewards: jax.Array, loss_mask: jax.Array, **inputs) -> Advantages:
    for key in self.needs:
      if inputs.get(key) is None:
        raise ValueError(f"Advantage estimator {self.name!r} needs `{key}`.")
    for key in _BATCH_INPUTS:
      if inputs.get(key) is not None and key not in self.needs + self.accepts:
        raise ValueError(f"Advantage estimator {self.name!r} does not use `{key}`; drop it.")
    return self.fn(rewards, loss_mask, **{
        key: value for key, value in inputs.items() if value is not None
    })


_GROUPS = ("group_ids", "num_groups")

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    estimator.name: estimator for estimator in (
        AdvantageEstimator(
            "grpo", _with_outcome_returns(grpo_advantages), needs=_GROUPS, hyperparameters=((
                "normalize_by_std", "grpo_normalize_by_std"), ("std", "grpo_std"), ("eps",
                                                                                    "grpo_eps"))),
        AdvantageEstimator("rloo", _with_outcome_returns(rloo_advantages), needs=_GROUPS),
        AdvantageEstimator("reinforce_plus_plus", reinforce_plus_plus_advantages, accepts=(
            "token_rewards",), hyperparameters=(("gamma", "gamma"),)),
        AdvantageEstimator("gae", gae_advantages, needs=("values",), accepts=(
            "token_rewards",), hyperparameters=(("gamma", "gamma"), ("lam", "lam"))),
    )
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
  """The estimator registered as `name`; a ValueError lists the valid names otherwise."""
  return registry.lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
