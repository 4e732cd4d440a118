"""Advantage estimators for multi-turn trajectories: GRPO, RLOO, REINFORCE++, GAE and GiGPO.

All functions are pure, jittable and work on a batch of right-padded token arrays:

  rewards:       f32[B]     outcome reward of each trajectory (1 success / 0 failure, or a score)
  loss_mask:     f32[B, T]  1 exactly on sampler-generated assistant tokens (incl. turn-end)
  group_ids:     int[B]     samples of one task share an id in [0, num_groups)
  values:        f32[B, T]  critic value at each token (GAE only)
  token_rewards: f32[B, T]  optional extra per-token rewards, e.g. a KL penalty
  turn_index:    int[B, T]  k on the tokens of a row's k-th assistant turn, -1 elsewhere (GiGPO)
  turn_rewards:  f32[B, K]  the environment's reward for turn k of each row, 0 past its turns
  turn_anchors:  int[B, K]  the anchor state of turn k (GiGPO), -1 for no turn

GiGPO takes the last three as one `Turns`, and its group scoring options as one `GroupScoring`.
`num_groups`, `normalize_by_std` and `std` are static under jit; gamma, lam, eps and GiGPO's step
weight may be traced (a GroupScoring is a pytree whose one leaf is eps).
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
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from agentgym_jax.rl import masked
from agentgym_jax.rl import registry


class Advantages(NamedTuple):
  advantages: jax.Array  # f32[B, T], 0 on untrained tokens
  returns: jax.Array  # f32[B, T], 0 on untrained tokens


class Turns(NamedTuple):
  """The turn structure of a batch, which GiGPO credits turn by turn (module docstring)."""

  index: jax.Array  # int[B, T] aligned with loss_mask: k on the tokens of turn k, -1 elsewhere
  rewards: jax.Array  # f32[B, K] the environment's reward for each turn slot, 0 past its turns
  anchors: jax.Array  # int[B, K] step-group id of each turn slot, -1 for a slot without a turn


@functools.partial(jax.tree_util.register_dataclass, data_fields=["eps"],
                   meta_fields=["normalize_by_std", "std"])
@dataclasses.dataclass(frozen=True)
class GroupScoring:
  """How `group_scores` scores each value against its group: divided by the group's std or
  not, the std "population" or "unbiased", and the eps added to it (see `group_scores`).

  A pytree: eps is its leaf (it may be traced), normalize_by_std and std are static.
  """

  normalize_by_std: bool = True
  std: str = "population"
  eps: float = 1e-6


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


def place_turn_rewards(turn_rewards: jax.Array, turn_index: jax.Array,
                       loss_mask: jax.Array) -> jax.Array:
  """Puts each turn's reward on the last trained token of that turn.

  Args:
    turn_rewards: f32[B, K] the reward of each turn slot.
    turn_index: int[B, T] aligned with loss_mask: k on the tokens of turn k, -1 elsewhere.
    loss_mask: [B, T] trained-token mask.

  Returns:
    f32[B, T] zeros except turn_rewards[b, k] at the last trained token of row b's turn k. A
    turn without a trained token gets no reward.
  """
  trained = loss_mask.astype(bool) & (turn_index >= 0)
  following = jnp.concatenate([turn_index[:, 1:], jnp.full_like(turn_index[:, :1], -1)], axis=1)
  following_trained = jnp.concatenate([trained[:, 1:], jnp.zeros_like(trained[:, :1])], axis=1)
  last = trained & ~(following_trained & (following == turn_index))
  reward = jnp.take_along_axis(turn_rewards.astype(jnp.float32), jnp.maximum(turn_index, 0), axis=1)
  return jnp.where(last, reward, 0.0)


REWARD_PLACEMENTS = ("outcome", "turn")


def _step_rewards(rewards: jax.Array, loss_mask: jax.Array, token_rewards: jax.Array | None,
                  placement: str, turn_index: jax.Array | None,
                  turn_rewards: jax.Array | None) -> jax.Array:
  """The per-token rewards of the token-level estimators: the outcome on the last trained token
  ("outcome") or each turn's reward on its last trained token ("turn"), plus token_rewards."""
  if placement == "outcome":
    placed = place_on_last_trained_token(rewards, loss_mask)
  elif placement == "turn":
    if turn_index is None or turn_rewards is None:
      raise ValueError("reward_placement='turn' needs `turn_index` and `turn_rewards`")
    placed = place_turn_rewards(turn_rewards, turn_index, loss_mask)
  else:
    raise ValueError(f"reward_placement={placement!r} is not one of {REWARD_PLACEMENTS}")
  return placed if token_rewards is None else placed + token_rewards


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


def group_scores(values: jax.Array, group_ids: jax.Array, num_groups: int, *,
                 normalize_by_std: bool = True, std: str = "population",
                 eps: float = 1e-6) -> jax.Array:
  """Each value scored against its group, as GRPO scores rewards:

    s_i = (v_i - mean_g(v)) / (std_g(v) + eps)    if normalize_by_std
    s_i =  v_i - mean_g(v)                        otherwise ("Dr. GRPO": no std scaling, which
                                                  would up-weight near-uniform groups)

  with the mean and std over the group g of element i. `std` is "population" (the default:
  [1, 0, 0, 1] -> [1, -1, -1, 1]) or "unbiased", Bessel-corrected as torch.std is in verl, TRL
  and AgentGym-RL: the population std times sqrt(n / (n - 1)) for a group of n, so their
  scores are those of "population" times sqrt((n - 1) / n) (up to eps). A group of size 1, or
  whose values are all equal, scores exactly 0, also with eps = 0.

  Args:
    values: f32[M].
    group_ids: int[M] with values in [0, num_groups).
    num_groups: static number of groups.

  Returns:
    f32[M] scores.
  """
  if std not in ("population", "unbiased"):
    raise ValueError(f"std={std!r} is not 'population' or 'unbiased'")
  mean, spread, size = group_mean_and_std(values, group_ids, num_groups)
  if std == "unbiased":
    spread = spread * jnp.sqrt(size / jnp.maximum(size - 1, 1))
  # A group's mean of equal values need not be that value in f32 (eight 0.7s average to
  # 0.7 + 1 ulp), and that rounding over a std of ~0 would be a score of order 0.1: a uniform
  # group scores exactly 0.
  uniform = (jax.ops.segment_max(values, group_ids,
                                 num_groups) == jax.ops.segment_min(values, group_ids, num_groups))
  centred = jnp.where(uniform[group_ids], 0.0, values - mean)
  if not normalize_by_std:
    return centred
  # With eps = 0 a singleton or uniform group would divide 0 by 0; its score is 0.
  denominator = spread + eps
  return centred / jnp.where(denominator > 0, denominator, 1.0)


def grpo_advantages(rewards: jax.Array, loss_mask: jax.Array, group_ids: jax.Array, *,
                    num_groups: int, normalize_by_std: bool = True, std: str = "population",
                    eps: float = 1e-6) -> jax.Array:
  """Group-relative advantage (GRPO), broadcast over the trajectory's trained tokens.

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)    if normalize_by_std
    A_i =  r_i - mean_g(r)                        otherwise

  over the samples g of trajectory i's task: `group_scores` of the outcome rewards, whose
  docstring gives the std options and the zero advantage of singleton and uniform groups. The
  outcome r_i is the sum of the episode's turn rewards: GRPO (and RLOO) credit every token
  with it, whatever turn earned it, so algorithm.reward_placement does not apply to them.

  Returns:
    f32[B, T] advantages, A_i on row i's trained tokens and 0 elsewhere.
  """
  scores = group_scores(rewards, group_ids, num_groups, normalize_by_std=normalize_by_std, std=std,
                        eps=eps)
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

  _, returns = jax.lax.scan(step, jnp.zeros(token_rewards.shape[0], jnp.float32),
                            (token_rewards.T.astype(jnp.float32), trained.T), reverse=True)
  return returns.T


def reinforce_plus_plus_advantages(rewards: jax.Array, loss_mask: jax.Array, *,
                                   token_rewards: jax.Array | None = None,
                                   reward_placement: str = "outcome",
                                   turn_index: jax.Array | None = None,
                                   turn_rewards: jax.Array | None = None, gamma: float = 1.0,
                                   eps: float = 1e-8) -> Advantages:
  """REINFORCE++: discounted token-level returns, whitened over every trained token in the batch.

  Over the trained tokens t_1 < ... < t_K of a row:

    r_k = R * [k = K] + token_rewards[t_k]         (outcome R on the last trained token)
    G_k = r_k + gamma * G_{k+1},  G_{K+1} = 0
    A   = (G - mean(G)) / sqrt(var(G) + eps)       (masked mean/var over the whole batch)

  With reward_placement "turn" each turn's reward (turn_rewards, turn_index as `Turns`) sits
  on the last trained token of its turn instead of R on the row's last: a turn's return counts
  the rewards of it and the turns after it, not those earned before. `token_rewards` on
  untrained positions are ignored.

  Returns:
    Advantages(advantages=A, returns=G), both f32[B, T] and 0 on untrained tokens.
  """
  step_rewards = _step_rewards(rewards, loss_mask, token_rewards, reward_placement, turn_index,
                               turn_rewards)
  returns = _discounted_returns(step_rewards, loss_mask, gamma)
  return Advantages(masked.masked_whiten(returns, loss_mask, eps), returns)


def gae_advantages(rewards: jax.Array, loss_mask: jax.Array, values: jax.Array, *,
                   token_rewards: jax.Array | None = None, reward_placement: str = "outcome",
                   turn_index: jax.Array | None = None, turn_rewards: jax.Array | None = None,
                   gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-8) -> Advantages:
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
  would miss it, which is the reference implementation's defect. With reward_placement "turn"
  r_k holds turn rewards as in `reinforce_plus_plus_advantages`.

  Returns:
    Advantages(advantages, returns), both f32[B, T] and 0 on untrained tokens.
  """
  step_rewards = _step_rewards(rewards, loss_mask, token_rewards, reward_placement, turn_index,
                               turn_rewards)
  trained = loss_mask.astype(bool)

  def step(carry, inputs):
    next_value, next_advantage = carry
    reward, value, is_trained = inputs
    delta = reward + gamma * next_value - value
    advantage = delta + gamma * lam * next_advantage
    # Only trained tokens advance the recursion; observation tokens are transparent.
    carry = (jnp.where(is_trained, value,
                       next_value), jnp.where(is_trained, advantage, next_advantage))
    return carry, jnp.where(is_trained, advantage, 0.0)

  batch_size = rewards.shape[0]
  zeros = jnp.zeros(batch_size, jnp.float32)
  values = values.astype(jnp.float32)
  _, raw_advantages = jax.lax.scan(step, (zeros, zeros),
                                   (step_rewards.T.astype(jnp.float32), values.T, trained.T),
                                   reverse=True)
  raw_advantages = raw_advantages.T
  returns = jnp.where(trained, raw_advantages + values, 0.0)
  return Advantages(masked.masked_whiten(raw_advantages, loss_mask, eps), returns)


def weight_negatives(advantages: jax.Array, negative_weight: float) -> jax.Array:
  """Advantages with every negative one scaled by `negative_weight` >= 0:

    A'_t = A_t              if A_t >= 0
    A'_t = w A_t            otherwise

  w < 1 bounds the push-down of what failed against the pull-up of what succeeded (w = 0 trains
  on the successes only, as rejection-sampling fine-tuning does): a policy near a good one fails
  in long episodes that share most of their tokens with its successes, and under token-mean
  aggregation their many negative tokens outweigh the successes' positive ones. w = 1 is the
  estimator's advantage unchanged.
  """
  if negative_weight < 0:
    raise ValueError(f"negative_weight must be >= 0, got {negative_weight}")
  if negative_weight == 1:
    return advantages
  return jnp.where(advantages < 0, negative_weight * advantages, advantages)


def turn_returns(turn_rewards: jax.Array, gamma: float = 1.0) -> jax.Array:
  """Discounted return of every turn: G_k = r_k + gamma * G_{k+1}, over the K turn slots of each
  row (slots past a row's last turn hold reward 0, so they add nothing).

  Args:
    turn_rewards: f32[B, K] the environment's reward for each turn.

  Returns:
    f32[B, K] returns G.
  """

  def step(next_return, reward):
    current = reward + gamma * next_return
    return current, current

  _, returns = jax.lax.scan(step, jnp.zeros(turn_rewards.shape[0], jnp.float32),
                            turn_rewards.T.astype(jnp.float32), reverse=True)
  return returns.T


def gigpo_advantages(rewards: jax.Array, loss_mask: jax.Array, group_ids: jax.Array, turns: Turns,
                     *, num_groups: int, step_weight: float = 1.0, gamma: float = 1.0,
                     scoring: GroupScoring = GroupScoring()) -> Advantages:
  """Group-in-Group Policy Optimization (Feng et al. 2025): GRPO's episode-level advantage plus
  a step-level advantage that compares the turns taken from the same state.

  Turn k of trajectory i answers an observation; its anchor state is that observation's token
  ids. Among all turns of the samples of i's task (trajectory i's other turns included), the
  turns with an identical anchor form the step group S(i, k): states that different
  trajectories (or one trajectory, twice) reached, such as the same TextCraft inventory, BabyAI
  view or SciWorld room. With r_{i,k} the environment's reward for turn k,

    G_{i,k}    = sum_{j >= k} gamma^(j - k) r_{i,j}              (discounted return of the turn)
    A^E_i      = group_scores(R)_i over the samples of i's task    (GRPO on outcome rewards R)
    A^S_{i,k}  = group_scores(G)_{i,k} over the step group S(i, k)
    A_{i,k}    = A^E_i + omega * A^S_{i,k}                        (omega = step_weight)

  and every trained token of turn k gets A_{i,k}. Both levels score as GRPO does
  (`group_scores`: mean/std with `scoring`'s normalize_by_std, std and eps); a turn whose
  anchor no other turn shares has A^S = 0. The first turn's anchor is the prompt, which a
  task's samples share, so for outcome rewards and gamma = 1 its step group is the episode
  group. (verl-agent takes the episode-level mean and std over a group's turns rather than its
  trajectories; here A^E is the paper's per-trajectory GRPO advantage.) Both reward placements
  are built in: the outcome at the episode level, each turn's reward at the step level, so
  algorithm.reward_placement does not apply.

  Args:
    rewards: f32[B] outcome rewards (the sum of each row's turn rewards).
    loss_mask: [B, T] trained-token mask.
    group_ids: int[B] task group of each row, in [0, num_groups).
    turns: the turn structure (`Turns`): index int[B, T] aligned with `loss_mask`, k on the
      tokens of turn k and -1 elsewhere; rewards f32[B, K] of each turn slot, 0 past a row's
      turns; anchors int[B, K], the step-group id of each turn in [0, B * K), -1 for a slot
      without a turn: turns share an id exactly when their task and anchor state are the same.
    num_groups: static number of task groups.
    step_weight: omega.
    gamma: the turn returns' discount.
    scoring: how both levels score against their group (`GroupScoring`).

  Returns:
    Advantages(advantages=A, returns=G of each token's turn), both f32[B, T] and 0 on
    untrained tokens.
  """
  options = dict(normalize_by_std=scoring.normalize_by_std, std=scoring.std, eps=scoring.eps)
  episode = grpo_advantages(rewards, loss_mask, group_ids, num_groups=num_groups, **options)
  returns = turn_returns(turns.rewards, gamma)
  num_turns = turns.anchors.size
  is_turn = turns.anchors >= 0
  # Slots without a turn share one extra group, whose scores are dropped.
  step_groups = jnp.where(is_turn, turns.anchors, num_turns).reshape(-1)
  step = group_scores(returns.reshape(-1), step_groups, num_turns + 1, **options)
  step = jnp.where(is_turn, step.reshape(turns.anchors.shape), 0.0)

  def per_token(per_turn: jax.Array) -> jax.Array:
    taken = jnp.take_along_axis(per_turn, jnp.maximum(turns.index, 0), axis=1)
    return jnp.where(turns.index >= 0, taken, 0.0) * loss_mask.astype(jnp.float32)

  return Advantages(episode + step_weight * per_token(step), per_token(returns))


def step_group_metrics(turn_anchors: jax.Array) -> dict[str, jax.Array]:
  """How much GiGPO's step level has to compare: the step groups of a batch's turns.

    step_group_size  mean over turns of |S(i, k)|, the number of turns in turn k's step group
    anchored_turns   the fraction of turns k >= 1 with |S(i, k)| > 1

  A first turn's anchor is its task's prompt, which every sample of the task shares, so its
  step group is the episode group and adds nothing to A^E (`gigpo_advantages`); later turns
  are where step groups of size > 1 give the turn-level credit GRPO lacks. A batch without
  later turns has anchored_turns 0.

  Args:
    turn_anchors: int[B, K] step-group ids as `gigpo_advantages` reads them, -1 for no turn.

  Returns:
    {"step_group_size": f32[], "anchored_turns": f32[]}.
  """
  num_turns = turn_anchors.size
  is_turn = turn_anchors >= 0
  ids = jnp.where(is_turn, turn_anchors, num_turns).reshape(-1)
  counts = jax.ops.segment_sum(
      is_turn.reshape(-1).astype(jnp.float32), ids, num_segments=num_turns + 1)
  sizes = counts[ids].reshape(turn_anchors.shape)
  later = is_turn.at[:, 0].set(False)
  return {
      "step_group_size": masked.masked_mean(sizes, is_turn),
      "anchored_turns": masked.masked_mean((sizes > 1).astype(jnp.float32), later),
  }


# The registry: each entry declares what it reads, so the learner passes exactly that and the
# config knows which algorithm.* keys set its hyperparameters. A new estimator is one entry here.

_TURNS = ("turn_index", "turn_rewards", "turn_anchors")
_BATCH_INPUTS = ("group_ids", "num_groups", "values", "token_rewards") + _TURNS


def _outcome_returns(rewards: jax.Array, loss_mask: jax.Array) -> jax.Array:
  # Undiscounted return of every trained token is the trajectory's outcome.
  return rewards[:, None] * loss_mask.astype(jnp.float32)


def _with_outcome_returns(advantages_fn: Callable[..., jax.Array]) -> Callable[..., Advantages]:
  """A group estimator whose critic target is the outcome itself."""

  def estimate(rewards: jax.Array, loss_mask: jax.Array, **inputs) -> Advantages:
    return Advantages(advantages_fn(rewards, loss_mask, **inputs),
                      _outcome_returns(rewards, loss_mask))

  return estimate


def _gigpo_estimate(rewards: jax.Array, loss_mask: jax.Array, *, turn_index: jax.Array,
                    turn_rewards: jax.Array, turn_anchors: jax.Array, **inputs) -> Advantages:
  """`gigpo_advantages` called as the registry calls an estimator: the turn structure as three
  batch inputs, the group scoring as the hyperparameters of its fields (GRPO's)."""
  names = [field.name for field in dataclasses.fields(GroupScoring)]
  scoring = GroupScoring(**{name: inputs.pop(name) for name in names if name in inputs})
  return gigpo_advantages(rewards, loss_mask, turns=Turns(turn_index, turn_rewards, turn_anchors),
                          scoring=scoring, **inputs)


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
  """A registry entry, called as

    advantages, returns = estimator(rewards, loss_mask, **inputs, **hyperparameters)

  Attributes:
    name: the config name (algorithm.advantage).
    fn: the estimator; it receives the batch inputs it declares, by keyword.
    needs: batch inputs it cannot run without (group_ids and num_groups for a group baseline,
      values for a critic, the turn structure for turn-level credit).
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

  @property
  def needs_turns(self) -> bool:
    return "turn_anchors" in self.needs

  def __call__(self, rewards: jax.Array, loss_mask: jax.Array, **inputs) -> Advantages:
    for key in self.needs:
      if inputs.get(key) is None:
        raise ValueError(f"Advantage estimator {self.name!r} needs `{key}`.")
    for key in _BATCH_INPUTS:
      if inputs.get(key) is not None and key not in self.needs + self.accepts:
        raise ValueError(f"Advantage estimator {self.name!r} does not use `{key}`; drop it.")
    return self.fn(rewards, loss_mask,
                   **{key: value for key, value in inputs.items() if value is not None})


_GROUPS = ("group_ids", "num_groups")
# A token-level estimator adds per-token rewards (a KL penalty) and places the environment's
# rewards on the outcome's token or on each turn's (algorithm.reward_placement).
_TOKEN_REWARDS = ("token_rewards", "turn_index", "turn_rewards")
_PLACED = (("reward_placement", "reward_placement"),)

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    estimator.name: estimator for estimator in (
        AdvantageEstimator(
            "grpo", _with_outcome_returns(grpo_advantages), needs=_GROUPS, hyperparameters=((
                "normalize_by_std", "grpo_normalize_by_std"), ("std", "grpo_std"), ("eps",
                                                                                    "grpo_eps"))),
        AdvantageEstimator("rloo", _with_outcome_returns(rloo_advantages), needs=_GROUPS),
        AdvantageEstimator("reinforce_plus_plus", reinforce_plus_plus_advantages,
                           accepts=_TOKEN_REWARDS, hyperparameters=_PLACED + (("gamma", "gamma"),)),
        AdvantageEstimator("gae", gae_advantages, needs=(
            "values",), accepts=_TOKEN_REWARDS, hyperparameters=_PLACED + (("gamma", "gamma"),
                                                                           ("lam", "lam"))),
        AdvantageEstimator(
            "gigpo", _gigpo_estimate, needs=_GROUPS +
            _TURNS, hyperparameters=(("step_weight", "gigpo_step_weight"), ("gamma", "gamma"),
                                     ("normalize_by_std", "grpo_normalize_by_std"),
                                     ("std", "grpo_std"), ("eps", "grpo_eps"))))
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
  """The estimator registered as `name`; a ValueError lists the valid names otherwise."""
  return registry.lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
