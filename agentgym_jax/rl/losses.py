"""Training losses for RL and offline fine-tuning, and per-token log-probs from logits.

Every loss is a pure, jittable function returning `(loss, metrics)`: a scalar to *minimise* (the
one exception, `entropy_bonus`, is to maximise and says so in its name) and a dict of scalar
diagnostics (kept on device; the caller decides when to read them). Per-token
losses take f32[B, T] arrays and a `loss_mask` [B, T] that is 1 exactly on sampler-generated
assistant tokens, and reduce with one of the `AGGREGATIONS`:

  "token-mean"               sum_{b,t} m l / sum_{b,t} m      every trained token weighs the same
  "seq-mean-token-mean"      mean_b [ sum_t m l / sum_t m ]   every trajectory weighs the same
  "seq-mean-token-sum"       mean_b [ sum_t m l ]             long trajectories weigh more
  "seq-mean-token-sum-norm"  mean_b [ sum_t m l ] / L         Dr. GRPO: a constant divisor L

The sequence means run over rows with at least one trained token, so all-padding rows that keep
a batch shape static do not dilute the loss. L (`scale_tokens`) is a constant such as the most
tokens a trajectory can have trained, so no trajectory's length rescales its tokens' gradient
(Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO); it defaults to the rows'
length T.

The policy losses (`POLICY_LOSSES`, chosen by algorithm.policy_loss) share one signature: PPO's
clipped surrogate, GSPO's sequence-level ratio, CISPO's clipped importance weight, and the
entropy controls Clip-Cov and KL-Cov, which act on the few tokens whose advantage and log-prob
covary most.

Hyperparameters (clip epsilons, beta, temperature, aggregation, chunk size) are Python values
validated eagerly, so they are static under jit (bind them with functools.partial).

A trainer combines them as, e.g. for GRPO,
  policy_gradient_loss + kl_coef * kl_loss - entropy_coef * entropy_bonus
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from agentgym_jax.models.attention import to_bits
from agentgym_jax.rl import masked
from agentgym_jax.rl import registry

Metrics = dict[str, jax.Array]

# exp() of a log-ratio beyond this overflows f32 quickly; a token this far off-policy is
# dominated by its bound anyway.
_MAX_LOG_RATIO = 20.0
# The reference clamps the k3 ("low_var_kl") estimate to this range; kept for parity, it also
# bounds the gradient when the policy has drifted far from the reference.
_K3_CLAMP = 10.0


def _token_mean(per_token: jax.Array, loss_mask: jax.Array) -> jax.Array:
  return masked.masked_mean(per_token, loss_mask)


def _seq_mean(per_sequence: jax.Array, loss_mask: jax.Array) -> jax.Array:
  has_tokens = jnp.any(loss_mask.astype(bool), axis=1)
  return masked.masked_mean(per_sequence, has_tokens)


def _seq_mean_token_mean(per_token: jax.Array, loss_mask: jax.Array) -> jax.Array:
  return _seq_mean(masked.masked_mean(per_token, loss_mask, axis=1), loss_mask)


def _seq_mean_token_sum(per_token: jax.Array, loss_mask: jax.Array) -> jax.Array:
  return _seq_mean(masked.masked_sum(per_token, loss_mask, axis=1), loss_mask)


def _seq_mean_token_sum_norm(per_token: jax.Array, loss_mask: jax.Array,
                             scale_tokens: float | None) -> jax.Array:
  scale = loss_mask.shape[1] if scale_tokens is None else scale_tokens
  return _seq_mean_token_sum(per_token, loss_mask) / scale


AGGREGATIONS: dict[str, Callable[..., jax.Array]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
# The aggregations that divide by a constant number of tokens, `scale_tokens`.
SCALED_AGGREGATIONS = ("seq-mean-token-sum-norm",)

# What each aggregation averages over. A batch's aggregate is the mean of its parts' aggregates
# weighted by each part's share of these units, which is how micro-batches add up to a batch.
AGGREGATION_UNITS = {
    "token-mean": "tokens",
    "seq-mean-token-mean": "rows",
    "seq-mean-token-sum": "rows",
    "seq-mean-token-sum-norm": "rows",
}


def aggregation_units(loss_mask: jax.Array, aggregation: str) -> jax.Array:
  """The number of units `aggregation` averages over in loss_mask [B, T]: trained tokens, or
  rows holding any."""
  units = registry.lookup(AGGREGATION_UNITS, aggregation, "loss aggregation")
  if units == "tokens":
    return jnp.sum(loss_mask.astype(jnp.float32))
  return jnp.sum(jnp.any(loss_mask.astype(bool), axis=1).astype(jnp.float32))


def aggregate(per_token: jax.Array, loss_mask: jax.Array, aggregation: str, *,
              scale_tokens: float | None = None) -> jax.Array:
  """Reduces f32[B, T] per-token values to a scalar with the named aggregation.

  `scale_tokens` is the constant divisor L of the scaled aggregations (None: the rows' length
  T); the others take none.
  """
  reduce = registry.lookup(AGGREGATIONS, aggregation, "loss aggregation")
  if aggregation in SCALED_AGGREGATIONS:
    if scale_tokens is not None and scale_tokens <= 0:
      raise ValueError(f"scale_tokens must be > 0, got {scale_tokens}.")
    return reduce(per_token, loss_mask, scale_tokens)
  if scale_tokens is not None:
    raise ValueError(f"Aggregation {aggregation!r} takes no scale_tokens; only "
                     f"{', '.join(SCALED_AGGREGATIONS)} divide by a constant.")
  return reduce(per_token, loss_mask)


def _ratio_metrics(ratio: jax.Array, token_log_ratio: jax.Array, loss_mask: jax.Array) -> Metrics:
  """Diagnostics over trained tokens: the KL from the per-token log-ratios log(pi / pi_old),
  the mean and max of the loss's ratio (per token, or per sequence for GSPO)."""
  return {
      # k3: E_old[rho - 1 - log rho] >= 0, unbiased for KL(old || new) and low-variance.
      "approx_kl": masked.masked_mean(jnp.exp(token_log_ratio) - 1.0 - token_log_ratio, loss_mask),
      "ratio_mean": masked.masked_mean(ratio, loss_mask),
      # ratio > 0, so 0 is a neutral fill for untrained tokens.
      "ratio_max": jnp.max(jnp.where(loss_mask.astype(bool), ratio, 0.0)),
  }


@dataclasses.dataclass(frozen=True)
class Clip:
  """A policy loss's clip range, checked when made: ratios (or CISPO's weights) are kept in
  [1 - low, 1 + high], high defaulting to low (symmetric); `dual_c` > 1 bounds PPO's loss of a
  token with negative advantage (dual clip; None: none). Hashable, so static under jit."""

  low: float
  high: float | None = None
  dual_c: float | None = None

  def __post_init__(self):
    if self.low <= 0 or self.upper <= 0:
      raise ValueError(f"Clip epsilons must be > 0, got eps_low={self.low}, eps_high={self.upper}.")
    if self.dual_c is not None and self.dual_c <= 1:
      raise ValueError(f"dual_clip_c must be > 1 (or None), got {self.dual_c}.")

  @property
  def upper(self) -> float:
    """eps_high: `high`, or `low` when None."""
    return self.low if self.high is None else self.high


def _no_dual_clip(clip: Clip, loss: str) -> None:
  if clip.dual_c is not None:
    raise ValueError(f"{loss} has no dual clip; got dual_c={clip.dual_c}.")


def _weighted(per_token: jax.Array, importance_weights: jax.Array | None) -> jax.Array:
  # The weights are constants of the batch (a behaviour-policy correction), never trained.
  if importance_weights is None:
    return per_token
  return per_token * jax.lax.stop_gradient(importance_weights)


def policy_gradient_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                         loss_mask: jax.Array, *, clip: Clip = Clip(0.2),
                         aggregation: str = "token-mean", scale_tokens: float | None = None,
                         importance_weights: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """PPO clipped surrogate, with optional clip-higher and dual-clip.

    rho_t = exp(logp_t - logp_old_t)
    l_t   = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
    l_t   = min(l_t, -c A_t)          where A_t < 0, if dual_clip_c = c > 1
    l_t   = w_t l_t                   with importance_weights w (constants)

  Clip-higher (eps_high > eps_low) lets low-probability tokens with positive advantage grow
  further; dual-clip bounds the loss of a token with negative advantage whose ratio has blown
  up, which would otherwise dominate the batch. The weights w correct for a sampler whose
  probabilities differ from the learner's (rl.correction: w_t = min(pi_old / pi_sampler, cap)).

  Args:
    logprobs: f32[B, T] log-probs of the sampled tokens under the policy being trained.
    old_logprobs: f32[B, T] log-probs under the policy that generated the rollout.
    advantages: f32[B, T].
    loss_mask: [B, T].
    clip: eps_low, eps_high and the dual clip's c (`Clip`).
    aggregation: one of AGGREGATIONS.
    scale_tokens: the constant divisor of a scaled aggregation.
    importance_weights: f32[B, T] per-token weights w, or None for w = 1.

  Returns:
    (loss, metrics) with metrics
      clip_fraction:      fraction of trained tokens where the clipped term is the active one
      dual_clip_fraction: fraction where the dual-clip bound is active (0 without dual clip)
      approx_kl:          KL(old || new) by the k3 estimator, mean over trained tokens
      ratio_mean, ratio_max: of rho over trained tokens
  """
  ppo = _ppo_terms(logprobs, old_logprobs, advantages, clip)
  metrics = {
      "clip_fraction": masked.masked_mean(ppo.clip_active.astype(jnp.float32), loss_mask),
      "dual_clip_fraction": masked.masked_mean(ppo.dual_clip_active.astype(jnp.float32), loss_mask),
      **_ratio_metrics(ppo.ratio, ppo.log_ratio, loss_mask),
  }
  per_token = _weighted(ppo.per_token, importance_weights)
  return aggregate(per_token, loss_mask, aggregation, scale_tokens=scale_tokens), metrics


class _PPOTerms(NamedTuple):
  per_token: jax.Array  # l_t
  clip_active: jax.Array  # where the clipped term is the larger
  dual_clip_active: jax.Array  # where the dual clip's bound replaced it
  ratio: jax.Array  # rho_t
  log_ratio: jax.Array  # log rho_t, clipped to +-_MAX_LOG_RATIO


def _ppo_terms(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
               clip: Clip) -> _PPOTerms:
  """`policy_gradient_loss`'s per-token loss l_t (before weights) and where its clips act."""
  log_ratio = jnp.clip(logprobs - old_logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - clip.low, 1.0 + clip.upper)
  per_token = jnp.maximum(unclipped, clipped)
  clip_active = clipped > unclipped
  if clip.dual_c is None:
    dual_clip_active = jnp.zeros_like(clip_active)
  else:
    dual_bound = -clip.dual_c * advantages
    dual_clip_active = (advantages < 0) & (per_token > dual_bound)
    per_token = jnp.where(dual_clip_active, dual_bound, per_token)
  return _PPOTerms(per_token, clip_active, dual_clip_active, ratio, log_ratio)


def gspo_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
              loss_mask: jax.Array, *, clip: Clip = Clip(3e-4, 4e-4),
              aggregation: str = "seq-mean-token-mean", scale_tokens: float | None = None,
              importance_weights: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): PPO's clip on one
  length-normalised ratio per trajectory instead of one per token.

    s_i   = exp( (1 / |y_i|) sum_t log(pi(y_i,t) / pi_old(y_i,t)) )       over trained tokens
    s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]                           (value s_i)
    l_i,t = max(-A_i,t s_i,t, -A_i,t clip(s_i,t, 1 - eps_low, 1 + eps_high))
    l_i,t = w_i,t l_i,t                                                   importance weights w

  This is the paper's GSPO-token form: with one advantage per trajectory (GRPO, RLOO) and the
  seq-mean-token-mean aggregation it is GSPO itself, loss -mean_i min(s_i A_i, clip(s_i) A_i)
  with gradient s_i A_i mean_t grad log pi(y_i,t) where unclipped; token-level advantages
  (REINFORCE++, GAE) weight each token's share. A trajectory is clipped or not as a whole, so
  the clip range is of the sequence ratio's scale: the paper's 3e-4 / 4e-4, not PPO's 0.2.

  Args and returns as `policy_gradient_loss` (no dual clip); clip_fraction counts the trained
  tokens of clipped trajectories, ratio_mean and ratio_max are of s over trained tokens, and
  approx_kl is the per-token k3 estimate.
  """
  _no_dual_clip(clip, "GSPO")
  token_log_ratio = jnp.clip(logprobs - old_logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  sequence_log_ratio = masked.masked_mean(token_log_ratio, loss_mask, axis=1)[:, None]
  # (log pi - sg[log pi]) + sg[log s_i]: the value of log s_i, the gradient of log pi. The
  # difference first, which is exactly 0: adding log s_i (~1e-4) to log pi (~-5) first would
  # round it at a relative 1e-3, the scale of GSPO's clip range.
  log_ratio = ((logprobs - jax.lax.stop_gradient(logprobs)) +
               jax.lax.stop_gradient(sequence_log_ratio))
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - clip.low, 1.0 + clip.upper)
  per_token = jnp.maximum(unclipped, clipped)
  metrics = {
      "clip_fraction": masked.masked_mean((clipped > unclipped).astype(jnp.float32), loss_mask),
      **_ratio_metrics(ratio, token_log_ratio, loss_mask),
  }
  per_token = _weighted(per_token, importance_weights)
  return aggregate(per_token, loss_mask, aggregation, scale_tokens=scale_tokens), metrics


def cispo_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
               loss_mask: jax.Array, *, clip: Clip = Clip(1.0, 5.0),
               aggregation: str = "token-mean", scale_tokens: float | None = None,
               importance_weights: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight.

    rho_t = exp(logp_t - logp_old_t)
    l_t   = -sg[clip(rho_t, 1 - eps_low, 1 + eps_high)] A_t logp_t
    l_t   = w_t l_t                                            importance weights w

  so grad l_t = -clip(rho_t) A_t grad logp_t. Unlike PPO's clip, which zeroes the gradient of
  a token whose ratio left the trust region, every token keeps its gradient and only its
  weight is bounded: rare tokens that matter for reflection keep contributing. eps_low = 1
  leaves the weight without a lower bound, as MiniMax-M1 does. The loss's value is that of a
  weighted log-likelihood, not of a surrogate near 0; its gradient is what counts.

  Args and returns as `policy_gradient_loss` (no dual clip); clip_fraction counts the trained
  tokens whose weight is clipped.
  """
  _no_dual_clip(clip, "CISPO")
  log_ratio = jnp.clip(logprobs - old_logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  weight = jnp.clip(ratio, 1.0 - clip.low, 1.0 + clip.upper)
  per_token = -jax.lax.stop_gradient(weight * advantages) * logprobs
  metrics = {
      "clip_fraction": masked.masked_mean((weight != ratio).astype(jnp.float32), loss_mask),
      **_ratio_metrics(ratio, log_ratio, loss_mask),
  }
  per_token = _weighted(per_token, importance_weights)
  return aggregate(per_token, loss_mask, aggregation, scale_tokens=scale_tokens), metrics


def advantage_logprob_covariance(advantages: jax.Array, logprobs: jax.Array,
                                 loss_mask: jax.Array) -> jax.Array:
  """Each trained token's term of the covariance between advantage and log-prob over the
  batch's trained tokens (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
  Reasoning Language Models", eq. 11):

    cov_t = (A_t - mean(A)) (logp_t - mean(logp))        means over trained tokens

  Tokens of high covariance are confident and rewarded (or unlikely and penalised): the updates
  on them are what lowers the policy's entropy. A constant of the batch (no gradient); 0 on
  untrained tokens."""
  logprobs = jax.lax.stop_gradient(logprobs)
  advantages = jax.lax.stop_gradient(advantages)
  centred = ((advantages - masked.masked_mean(advantages, loss_mask)) *
             (logprobs - masked.masked_mean(logprobs, loss_mask)))
  return jnp.where(loss_mask.astype(bool), centred, 0.0)


def first_in_order(priority: jax.Array, eligible: jax.Array, count: jax.Array) -> jax.Array:
  """The `count` eligible elements of lowest `priority` (ties by position), as a bool mask of
  priority's shape; all of them if fewer are eligible."""
  flat = jnp.where(eligible, priority, jnp.inf).reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
  return eligible & (rank.reshape(priority.shape) < count)


def _selected_count(ratio: float, loss_mask: jax.Array) -> jax.Array:
  """max(floor(ratio x trained tokens), 1), as verl counts the tokens Clip-Cov and KL-Cov act on."""
  trained = jnp.sum(loss_mask.astype(bool))
  return jnp.maximum(jnp.floor(ratio * trained.astype(jnp.float32)).astype(jnp.int32), 1)


def clip_cov_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                  loss_mask: jax.Array, *, key: jax.Array, clip: Clip = Clip(0.2),
                  clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                  aggregation: str = "token-mean", scale_tokens: float | None = None,
                  importance_weights: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """Clip-Cov (Cui et al. 2025, sec. 4.2; verl's policy_loss clip_cov): PPO's clipped surrogate
  whose gradient is removed from a few tokens of high covariance, against entropy collapse.

    cov_t  = `advantage_logprob_covariance` at token t
    C      = the trained tokens PPO's clip leaves active with clip_cov_lb < cov_t < clip_cov_ub
    D      = max(floor(clip_cov_ratio x trained tokens), 1) tokens of C drawn uniformly with
             `key` (all of C if it is smaller)
    l_t    = 0 on D, PPO's max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high)) elsewhere
    l_t    = w_t l_t                   with importance_weights w

  A token of D still counts in the aggregation's denominator, as in verl. The draw is a pure
  function of `key` (the update's: a resumed run draws what an uninterrupted one draws).

  Returns:
    (loss, metrics) with clip_fraction (PPO's clip active), cov_detached_fraction (|D| over
    the trained tokens), approx_kl, ratio_mean and ratio_max as `policy_gradient_loss`.
  """
  _no_dual_clip(clip, "Clip-Cov")
  if clip_cov_ratio <= 0 or clip_cov_lb >= clip_cov_ub:
    raise ValueError(f"Clip-Cov needs clip_cov_ratio > 0 and clip_cov_lb < clip_cov_ub, got "
                     f"{clip_cov_ratio}, {clip_cov_lb}, {clip_cov_ub}")
  ppo = _ppo_terms(logprobs, old_logprobs, advantages, clip)
  covariance = advantage_logprob_covariance(advantages, logprobs, loss_mask)
  candidates = (loss_mask.astype(bool) & ~ppo.clip_active & (covariance > clip_cov_lb) &
                (covariance < clip_cov_ub))
  detached = first_in_order(jax.random.uniform(key, covariance.shape), candidates,
                            _selected_count(clip_cov_ratio, loss_mask))
  per_token = jnp.where(detached, 0.0, ppo.per_token)
  metrics = {
      "clip_fraction": masked.masked_mean(ppo.clip_active.astype(jnp.float32), loss_mask),
      "cov_detached_fraction": masked.masked_mean(detached.astype(jnp.float32), loss_mask),
      **_ratio_metrics(ppo.ratio, ppo.log_ratio, loss_mask),
  }
  per_token = _weighted(per_token, importance_weights)
  return aggregate(per_token, loss_mask, aggregation, scale_tokens=scale_tokens), metrics


def kl_cov_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                loss_mask: jax.Array, *, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 1.0,
                aggregation: str = "token-mean", scale_tokens: float | None = None,
                importance_weights: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """KL-Cov (Cui et al. 2025, sec. 4.2; verl's policy_loss kl_cov): the unclipped surrogate,
  with a KL penalty on the tokens of largest covariance.

    K   = the max(floor(kl_cov_ratio x trained tokens), 1) trained tokens of largest
          `advantage_logprob_covariance` (ties by position)
    l_t = -A_t rho_t + ppo_kl_coef |log rho_t|     on K
    l_t = -A_t rho_t                               elsewhere (no clip, as in the paper)
    l_t = w_t l_t                                  with importance_weights w

  Returns:
    (loss, metrics) with cov_penalised_fraction (|K| over the trained tokens), abs_kl (the mean
    |log rho| over trained tokens), approx_kl, ratio_mean and ratio_max.
  """
  if kl_cov_ratio <= 0 or ppo_kl_coef < 0:
    raise ValueError(f"KL-Cov needs kl_cov_ratio > 0 and ppo_kl_coef >= 0, got {kl_cov_ratio}, "
                     f"{ppo_kl_coef}")
  log_ratio = jnp.clip(logprobs - old_logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
  ratio = jnp.exp(log_ratio)
  covariance = advantage_logprob_covariance(advantages, logprobs, loss_mask)
  penalised = first_in_order(-covariance, loss_mask.astype(bool),
                             _selected_count(kl_cov_ratio, loss_mask))
  per_token = -advantages * ratio + jnp.where(penalised, ppo_kl_coef * jnp.abs(log_ratio), 0.0)
  metrics = {
      "cov_penalised_fraction": masked.masked_mean(penalised.astype(jnp.float32), loss_mask),
      "abs_kl": masked.masked_mean(jnp.abs(log_ratio), loss_mask),
      **_ratio_metrics(ratio, log_ratio, loss_mask),
  }
  per_token = _weighted(per_token, importance_weights)
  return aggregate(per_token, loss_mask, aggregation, scale_tokens=scale_tokens), metrics


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """A registry entry: `fn(logprobs, old_logprobs, advantages, loss_mask, *, aggregation,
  scale_tokens, importance_weights, **more)`, where `more` holds

    clip      a `Clip` of the algorithm.* keys `clip_keys` (with a dual clip's c only if
              `dual_clip`); None: the loss has no clip range
    options   the algorithm.* keys it reads, passed under their own names
    key       a PRNG key, if it `draws` (its token choice is random)
  """

  name: str
  fn: Callable[..., tuple[jax.Array, Metrics]]
  clip_keys: tuple[str, str] | None
  dual_clip: bool = False
  options: tuple[str, ...] = ()
  draws: bool = False


POLICY_LOSSES: dict[str, PolicyLoss] = {
    entry.name: entry
    for entry in (PolicyLoss("ppo", policy_gradient_loss, ("clip_eps_low",
                                                           "clip_eps_high"), dual_clip=True),
                  PolicyLoss("gspo", gspo_loss, ("gspo_clip_eps_low", "gspo_clip_eps_high")),
                  PolicyLoss("cispo", cispo_loss, ("cispo_clip_eps_low", "cispo_clip_eps_high")),
                  PolicyLoss("clip_cov", clip_cov_loss, ("clip_eps_low", "clip_eps_high"), options=(
                      "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), draws=True),
                  PolicyLoss("kl_cov", kl_cov_loss, None, options=("kl_cov_ratio", "ppo_kl_coef")))
}


def get_policy_loss(name: str) -> PolicyLoss:
  """The policy loss registered as `name`; a ValueError lists the valid names otherwise."""
  return registry.lookup(POLICY_LOSSES, name, "policy loss")


def _k1(log_ratio: jax.Array) -> jax.Array:
  return log_ratio


def _k2(log_ratio: jax.Array) -> jax.Array:
  return 0.5 * jnp.square(log_ratio)


def _k3(log_ratio: jax.Array) -> jax.Array:
  # The log-ratio is bounded before exp(): exp(-d) overflows f32 for d < -88.7, and the clamp's
  # gradient 0 times the inf of exp's would be NaN. Every |d| >= _MAX_LOG_RATIO already clamps the
  # estimate (exp(20) - 21 and 19 both exceed _K3_CLAMP), so the value is unchanged.
  reverse = -jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # logp_ref - logp
  return jnp.clip(jnp.exp(reverse) - reverse - 1.0, -_K3_CLAMP, _K3_CLAMP)


def _abs(log_ratio: jax.Array) -> jax.Array:
  return jnp.abs(log_ratio)


# Under their names and verl's: kl (k1), mse (k2), low_var_kl (k3), abs.
KL_ESTIMATORS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "k1": _k1,
    "kl": _k1,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
    "abs": _abs,
}


def kl_divergence(logprobs: jax.Array, ref_logprobs: jax.Array,
                  estimator: str = "low_var_kl") -> jax.Array:
  """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

  With d = logp - logp_ref:
    k1 = d                           unbiased, high variance, can be negative
    k2 = d^2 / 2                     biased, low variance
    k3 = exp(-d) + d - 1             unbiased, low variance, >= 0 ("low_var_kl"),
                                     clamped to [-10, 10] as the reference does
    abs = |d|

  Names as verl's too: "kl" is k1, "mse" k2, "low_var_kl" k3.

  Returns:
    f32[B, T] per-token estimates (untrained tokens are not masked here).
  """
  kl_fn = registry.lookup(KL_ESTIMATORS, estimator, "KL estimator")
  return kl_fn(logprobs.astype(jnp.float32) - ref_logprobs.astype(jnp.float32))


def kl_loss(logprobs: jax.Array, ref_logprobs: jax.Array, loss_mask: jax.Array, *,
            estimator: str = "low_var_kl", aggregation: str = "token-mean",
            scale_tokens: float | None = None) -> tuple[jax.Array, Metrics]:
  """KL to the frozen reference policy as a loss term: aggregate(kl_divergence(...))."""
  loss = aggregate(kl_divergence(logprobs, ref_logprobs, estimator), loss_mask, aggregation,
                   scale_tokens=scale_tokens)
  return loss, {"kl": loss}


def kl_penalty_rewards(logprobs: jax.Array, ref_logprobs: jax.Array, loss_mask: jax.Array, *,
                       beta: float, estimator: str = "k1") -> jax.Array:
  """Per-token reward penalty -beta * KL_t on trained tokens, for REINFORCE++ and GAE.

  It is a reward, not a loss: gradients are stopped so it only enters through the advantages.

  Returns:
    f32[B, T], 0 on untrained tokens.
  """
  kl = kl_divergence(logprobs, ref_logprobs, estimator)
  return jax.lax.stop_gradient(jnp.where(loss_mask.astype(bool), -beta * kl, 0.0))


def entropy_bonus(entropies: jax.Array, loss_mask: jax.Array, *, aggregation: str = "token-mean",
                  scale_tokens: float | None = None) -> tuple[jax.Array, Metrics]:
  """Aggregated policy entropy H, to be maximised: subtract coef * H from the loss (coef > 0).

  Args:
    entropies: f32[B, T] per-token entropies, e.g. from `token_logprobs_and_entropy`.
    loss_mask: [B, T].
    aggregation: one of AGGREGATIONS.
    scale_tokens: the constant divisor of a scaled aggregation.
  """
  entropy = aggregate(entropies, loss_mask, aggregation, scale_tokens=scale_tokens)
  return entropy, {"entropy": entropy}


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, loss_mask: jax.Array,
               *, clip_eps: float = 0.2, aggregation: str = "token-mean",
               scale_tokens: float | None = None) -> tuple[jax.Array, Metrics]:
  """PPO clipped value loss.

    l_t = 0.5 * max((v_t - R_t)^2, (clip(v_t, v_old_t - eps, v_old_t + eps) - R_t)^2)

  Args:
    values: f32[B, T] current critic values.
    old_values: f32[B, T] critic values when the advantages were computed.
    returns: f32[B, T] regression targets (e.g. from gae_advantages).
    loss_mask: [B, T].
    clip_eps: eps > 0.
    aggregation: one of AGGREGATIONS.
    scale_tokens: the constant divisor of a scaled aggregation.

  Returns:
    (loss, metrics) with value_clip_fraction (tokens where the clipped error is the larger)
    and value_mse (unclipped mean squared error over trained tokens).
  """
  if clip_eps <= 0:
    raise ValueError(f"Value clip epsilon must be > 0, got {clip_eps}.")
  clipped_values = jnp.clip(values, old_values - clip_eps, old_values + clip_eps)
  unclipped_error = jnp.square(values - returns)
  clipped_error = jnp.square(clipped_values - returns)
  per_token = 0.5 * jnp.maximum(unclipped_error, clipped_error)
  metrics = {
      "value_clip_fraction":
          masked.masked_mean((clipped_error > unclipped_error).astype(jnp.float32), loss_mask),
      "value_mse":
          masked.masked_mean(unclipped_error, loss_mask),
  }
  return aggregate(per_token, loss_mask, aggregation, scale_tokens=scale_tokens), metrics


def sft_loss(logprobs: jax.Array, loss_mask: jax.Array, *,
             aggregation: str = "token-mean") -> tuple[jax.Array, Metrics]:
  """Supervised fine-tuning: negative log-likelihood of the target tokens, aggregated.

    loss = aggregate(-log p(y_t | y_<t))   (token-mean by default)
  """
  nll = aggregate(-logprobs, loss_mask, aggregation)
  return nll, {"nll": nll}


def sequence_logprobs(token_logprobs: jax.Array, loss_mask: jax.Array) -> jax.Array:
  """log p(y | x) = sum_t over trained tokens of log p(y_t | ...): f32[B, T] -> f32[B]."""
  return masked.masked_sum(token_logprobs, loss_mask, axis=1)


def dpo_loss(policy_chosen_logps: jax.Array, policy_rejected_logps: jax.Array,
             ref_chosen_logps: jax.Array, ref_rejected_logps: jax.Array, *,
             beta: float = 0.1) -> tuple[jax.Array, Metrics]:
  """Direct preference optimisation from per-sequence summed log-probs (f32[B] each).

    r_c  = beta * (log pi(y_c) - log pi_ref(y_c))        implicit reward of the chosen reply
    r_r  = beta * (log pi(y_r) - log pi_ref(y_r))        ... and of the rejected one
    loss = mean_b [ -log sigmoid(r_c - r_r) ]

  Returns:
    (loss, metrics) with reward_accuracy (fraction with r_c > r_r), reward_margin
    (mean r_c - r_r), chosen_reward and rejected_reward (means).
  """
  if beta <= 0:
    raise ValueError(f"DPO beta must be > 0, got {beta}.")
  chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
  rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
  margins = chosen_rewards - rejected_rewards
  loss = -jnp.mean(jax.nn.log_sigmoid(margins))
  metrics = {
      "reward_accuracy": jnp.mean((margins > 0).astype(jnp.float32)),
      "reward_margin": jnp.mean(margins),
      "chosen_reward": jnp.mean(chosen_rewards),
      "rejected_reward": jnp.mean(rejected_rewards),
  }
  return loss, metrics


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array, *,
                               temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Log-prob of each target token and the entropy of each next-token distribution.

  Computed in f32 whatever the logits' dtype (bf16 log-softmax over a 150k vocabulary loses
  the small differences PPO ratios are made of):

    z_t    = logits_t / temperature
    logp_t = z_t[y_t] - logsumexp(z_t)
    H_t    = -sum_v p_t,v log p_t,v,   log p_t = z_t - logsumexp(z_t)

  `temperature` must equal the sampler's, so the trained distribution is the sampled one.

  Args:
    logits: [B, T, V] (any float dtype); logits[b, t] predicts targets[b, t].
    targets: int[B, T].
    temperature: > 0.

  Returns:
    (logprobs, entropies), each f32[B, T].
  """
  if temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}.")
  scaled = logits.astype(jnp.float32) / temperature
  log_probs = scaled - jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
  # -sum p log p rather than logsumexp(z) - sum p z: the latter subtracts two numbers of the
  # logits' magnitude and loses ~10x more f32 precision.
  entropies = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
  return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0], entropies


def chunked_token_logprobs_and_entropy(hidden: jax.Array, targets: jax.Array, weight: jax.Array, *,
                                       vocab_major: bool = True, dtype: Any = jnp.float32,
                                       chunk_size: int, block_size: int | None = None,
                                       temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """`token_logprobs_and_entropy` of the logits hidden @ weight, never holding [B, T, V] at once.

  The vocabulary projection (inputs cast to `dtype`, f32 accumulation) runs block by block over
  the sequence, `block_size` positions of every row at a time (default: `chunk_size`), and each
  block is reduced to its statistics at once, in one pass over exp(z - max z):

    S = sum_v exp(z_v - m),   A = sum_v exp(z_v - m) (z_v - m),   m = max_v z_v
    logsumexp z = m + log S,   logp_t = (z_y - m) - log S,   H_t = log S - A / S

  (both terms of H are >= 0, so no precision is lost to cancellation). The gradient has its own
  VJP: with p = exp(z - logsumexp z), the cotangents g of the log-probs and gH of the entropies
  give

    dL/dz_v = g (1[v = y] - p_v) - gH p_v (log p_v + H)

  computed block by block from recomputed logits and cast to `dtype`; then, one chunk of
  `chunk_size` positions at a time, dL/dhidden = dz weight^T and dL/dweight += hidden^T dz are
  two matmuls with `dtype` inputs and f32 accumulation. Only a [B, chunk_size, V] block of
  `dtype` cotangents (and a [B, block_size, V] block of f32 logits) exists at a time. Small
  blocks keep the exp and the reductions in cache on a CPU; the learner's blocks hold
  LossConfig.logprob_block_tokens tokens, by default hardware.logits_block_tokens.

  Args:
    hidden: [B, T, E] final hidden states.
    targets: int[B, T].
    weight: the unembedding, [V, E] (`vocab_major`, a tied embedding) or [E, V].
    dtype: the matmuls' input dtype.
    chunk_size: positions per chunk of the backward pass; T is padded up to a multiple of it.
    block_size: positions per block (a divisor of chunk_size is used: the largest <= it).
    temperature: > 0, as in `token_logprobs_and_entropy`.

  Returns:
    (logprobs, entropies), each f32[B, T].
  """
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be > 0, got {chunk_size}.")
  if temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}.")
  block = min(block_size or chunk_size, chunk_size)
  if block <= 0:
    raise ValueError(f"block_size must be > 0, got {block_size}.")
  while chunk_size % block:
    block -= 1
  num_tokens = hidden.shape[1]
  padding = -num_tokens % chunk_size
  hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, padding)))
  head = _LinearHead("ve" if vocab_major else "ev", jnp.dtype(dtype), chunk_size, block,
                     float(temperature))
  logprobs, entropies = _linear_logprobs(head, hidden, weight, targets)
  return logprobs[:, :num_tokens], entropies[:, :num_tokens]


@dataclasses.dataclass(frozen=True)
class _LinearHead:
  """The static settings of `_linear_logprobs` (see chunked_token_logprobs_and_entropy)."""
  weight_spec: str  # "ve" or "ev"
  dtype: Any
  chunk: int
  block: int
  temperature: float

  def statistics(self, hidden_block: jax.Array, weight: jax.Array, target_block: jax.Array):
    """(z - m, exp(z - m), S, log S, log-probs, entropies) of a block's logits z [B, s, V]."""
    z = jnp.einsum(f"bse,{self.weight_spec}->bsv", hidden_block.astype(self.dtype),
                   weight.astype(self.dtype), preferred_element_type=jnp.float32)
    z = z / self.temperature
    centred = z - jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(centred)
    s = jnp.sum(e, axis=-1)
    log_s = jnp.log(s)
    target = jnp.take_along_axis(centred, target_block[..., None], axis=-1)[..., 0]
    entropy = log_s - jnp.sum(e * centred, axis=-1) / s
    return centred, e, s, log_s, target - log_s, entropy

  def blocks(self, x: jax.Array) -> jax.Array:
    """[B, T, ...] -> [T / block, B, block, ...]."""
    return x.reshape(x.shape[0], -1, self.block, *x.shape[2:]).swapaxes(0, 1)

  def unblocks(self, x: jax.Array) -> jax.Array:
    """The inverse of `blocks`."""
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear_logprobs(head: _LinearHead, hidden: jax.Array, weight: jax.Array,
                     targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  return _linear_logprobs_forward(head, hidden, weight, targets)[0]


def _linear_logprobs_forward(head: _LinearHead, hidden: jax.Array, weight: jax.Array,
                             targets: jax.Array):
  # The backward pass recomputes each block's statistics with its logits rather than keeping
  # them: the forward pass is then the same computation with or without a gradient (a DPO
  # reference and the policy it starts as give equal log-probs to the last bit).
  block = lambda inputs: head.statistics(inputs[0], weight, inputs[1])[-2:]
  logprobs, entropies = map(head.unblocks,
                            jax.lax.map(block, (head.blocks(hidden), head.blocks(targets))))
  residuals = (hidden, weight, targets)
  return (logprobs, entropies), residuals


def _linear_logprobs_backward(head: _LinearHead, residuals, cotangents):
  hidden, weight, targets = residuals
  g_logprobs, g_entropies = cotangents
  vocab = weight.shape[head.weight_spec.index("v")]
  per_chunk = head.chunk // head.block

  def block(inputs):
    hidden_block, target_block, g, g_h = inputs
    centred, e, s, log_s, _, entropy = head.statistics(hidden_block, weight, target_block)
    p = e / s[..., None]
    hit = jnp.arange(vocab, dtype=target_block.dtype) == target_block[..., None]
    dz = (g[..., None] * (hit - p) - g_h[..., None] * p *
          (centred - log_s[..., None] + entropy[..., None]))
    # As raw bits: XLA:CPU would convert the whole stacked bf16 output to f32 and back around
    # each block's write.
    return to_bits((dz / head.temperature).astype(head.dtype))

  def chunk(d_weight, inputs):
    hidden_chunk = inputs[0]
    dz = jax.lax.bitcast_convert_type(jax.lax.map(block, inputs), head.dtype)  # [n, B, s, V]
    d_hidden = jnp.einsum(f"nbsv,{head.weight_spec}->nbse", dz, weight.astype(head.dtype),
                          preferred_element_type=jnp.float32)
    # Summed as [E, V] whatever the weight's layout: the dot then reads dz as it lies,
    # [tokens, V] (a [V, E] result would transpose all of dz first).
    d_weight = d_weight + jnp.einsum("nbse,nbsv->ev", hidden_chunk.astype(head.dtype), dz,
                                     preferred_element_type=jnp.float32)
    return d_weight, d_hidden

  per_block = [head.blocks(x) for x in (hidden, targets, g_logprobs, g_entropies)]
  chunks = [x.reshape(-1, per_chunk, *x.shape[1:]) for x in per_block]
  d_weight, d_hidden = jax.lax.scan(chunk, jnp.zeros((hidden.shape[-1], vocab), jnp.float32),
                                    chunks)
  if head.weight_spec == "ve":
    # Behind a barrier: folded into the dot, the transpose would make XLA:CPU transpose dz.
    d_weight = jax.lax.optimization_barrier(d_weight).T
  d_hidden = head.unblocks(d_hidden.reshape(-1, *d_hidden.shape[2:]))
  return d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype), None


_linear_logprobs.defvjp(_linear_logprobs_forward, _linear_logprobs_backward)
