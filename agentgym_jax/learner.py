"""The learner: per-token log-probs of a batch of trajectories and the jitted policy update,
and the offline updates (an SFT step, a DPO step) that offline.py's loop runs.

Every per-token array it computes (logprobs, entropies, values, advantages) is aligned with the
*targets* tokens[:, 1:] of its `Batch` (agentgym_jax/batch.py).

The update is PPO-style: `ppo_epochs` passes over the batch in `num_minibatches` shuffled
minibatches, each one optimizer step, against old log-probs computed once before the first pass
(the first minibatch, whose parameters are still the experience's, takes its own log-probs as
the old ones: its ratio is exactly 1, where a separately compiled pass may round differently).
The policy loss is PPO's clip, GSPO's, CISPO's, Clip-Cov's or KL-Cov's (rl.POLICY_LOSSES); the
rollout correction (rl.correction) weights its tokens or drops trajectories whose sampler
probabilities stray too far from the learner's.

Micro-batches (`LossConfig.micro_batch_rows`, 0 for none) bound the activations of a forward and
backward pass: the experience pass runs its forward passes micro-batch by micro-batch, and the
update accumulates the gradient of each micro-batch's loss weighted by its share of the
aggregation's units (trained tokens for token-mean, rows for the sequence means), which sums to
the gradient of the whole minibatch's loss. Micro-batch j of an [M, T] batch holds rows j, j + n,
j + 2n, ... (n = M / micro_batch_rows), so on a mesh every micro-batch spans every device's rows.

LoRA (agentgym_jax/models/lora.py). With a frozen base (`Networks.frozen`, the base parameters)
the graph is a lora.LoraModel's and the parameters are its adapters: the forward runs base +
adapters and the gradient reaches the adapters only. The reference is then the initial adapters
(B = 0), which is the base exactly. The update's `key` drops the adapters' input
(model.lora.dropout); the experience pass runs without dropout.

Shared prompts (Batch.shared, agentgym_jax/batch.py): the forward passes run on packed rows, one
per task, and every per-token array is read back per sample, so advantages, masks, the rollout
correction and the aggregation's units are those of the unshared rows. Minibatches and
micro-batches then take whole tasks (`minibatch_indices` with row_groups, `take_batch`,
`split_micro_batches`), so that each computes a task's prompt once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from agentgym_jax import hardware, rl
from agentgym_jax.batch import Batch, SharedPrompts
from agentgym_jax.models.decoder import Decoder

Array = jax.Array


@struct.dataclass
class Experience:
  """What the update needs besides the batch, aligned with the targets tokens[:, 1:]."""

  old_logprobs: Array  # f32[N, T-1]
  ref_logprobs: Array  # f32[N, T-1] (zeros when no reference model is used)
  old_values: Array  # f32[N, T-1] (zeros without a critic)
  advantages: Array  # f32[N, T-1]
  returns: Array  # f32[N, T-1]
  rollout_weights: Array  # f32[N, T-1] rollout correction weights (ones without one)
  kept: Array  # f32[N] 0 for a trajectory the rollout correction drops from the loss


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The static (hashable) loss settings compiled into the update."""

  advantage_estimator: str = "grpo"
  advantage_options: tuple[tuple[str, Any], ...] = ()
  negative_advantage_weight: float = 1.0  # rl.weight_negatives' w.
  policy_loss: str = "ppo"  # A name in rl.POLICY_LOSSES; the clip range below is its own.
  policy_loss_options: tuple[tuple[str, Any], ...] = ()  # Its options (PolicyLoss.options).
  clip_eps_low: float = 0.2
  clip_eps_high: float | None = None
  dual_clip_c: float | None = None
  aggregation: str = "token-mean"
  loss_scale_tokens: float | None = None  # The divisor of a scaled aggregation.
  rollout_correction: str = "none"
  rollout_correction_cap: float = 2.0
  kl_coef: float = 0.0
  kl_estimator: str = "low_var_kl"
  kl_in_reward_coef: float = 0.0
  kl_in_reward_estimator: str = "k1"
  entropy_coef: float = 0.0
  value_coef: float = 0.0
  value_clip_eps: float = 0.2
  temperature: float = 1.0
  logprob_chunk: int = 512
  # Tokens per block within a chunk (0: one block); the hardware's choice by default.
  logprob_block_tokens: int = dataclasses.field(default_factory=hardware.logits_block_tokens)
  micro_batch_rows: int = 0

  @property
  def uses_reference(self) -> bool:
    return self.kl_coef > 0 or self.kl_in_reward_coef > 0

  @property
  def uses_critic(self) -> bool:
    return rl.get_advantage_estimator(self.advantage_estimator).needs_values


@struct.dataclass
class Networks:
  """The networks an update runs besides the weights it trains, as one argument.

  Attributes:
    graphdef: the policy's module graph (a Decoder's, or with LoRA a lora.LoraModel's).
    value_graphdef: the value head's graph (PPO's critic), or None.
    frozen: LoRA's base parameters, which the adapters train over, or None.

  The graphs are static (jit compiles once per pair of graphs); the frozen base is an array
  argument, never donated.
  """

  graphdef: nnx.GraphDef = struct.field(pytree_node=False)
  value_graphdef: nnx.GraphDef | None = struct.field(pytree_node=False, default=None)
  frozen: nnx.State | None = None

  def value_head(self, value_params: nnx.State | None) -> ValueHead | None:
    return None if self.value_graphdef is None else nnx.merge(self.value_graphdef, value_params)


@struct.dataclass
class UpdateState:
  """What an optimizer step reads and replaces (its buffers donated): the trained parameters
  and the optimizer's state of them. RL trains (policy or adapters, value head or None); SFT
  and DPO the policy (or adapters) alone."""

  trainable: Any
  opt_state: optax.OptState


class ValueHead(nnx.Module):
  """The critic for PPO/GAE: a linear value head on the policy's final hidden states."""

  def __init__(self, hidden_size: int):
    self.kernel = nnx.Param(jnp.zeros((hidden_size,), jnp.float32), axes=("norm",))
    self.bias = nnx.Param(jnp.zeros((), jnp.float32), axes=())

  def __call__(self, hidden: Array) -> Array:
    return hidden @ self.kernel.value + self.bias.value


def make_optimizer(learning_rate: float | optax.Schedule, *, weight_decay: float = 0.01,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, grad_clip: float = 1.0,
                   max_consecutive_nonfinite: int = 5) -> optax.GradientTransformation:
  """AdamW after global-norm clipping; a non-finite gradient skips the step (counted)."""
  return optax.apply_if_finite(
      optax.chain(optax.clip_by_global_norm(grad_clip),
                  optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)),
      max_consecutive_errors=max_consecutive_nonfinite)


def token_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, loss: LossConfig,
                   value_head: ValueHead | None = None, frozen: nnx.State | None = None,
                   dropout_key: Array | None = None) -> tuple[Array, Array, Array]:
  """(logprobs, entropies, values), each f32[N, T-1], aligned with the targets.

  The vocabulary projection runs chunk by chunk over the sequence, so full [N, T, V] f32
  logits never exist (a 152k vocabulary at 8k tokens would be 5 GB per row). With LoRA's
  `frozen` base, `params` are the adapters (module docstring). Rows of several contexts
  (batch.context_spans) are read window by window (`_window_by_window`). In the
  shared-prompt layout (batch.shared) the forward pass and the projection run on the packed
  rows, each group's prompt once, and every sample reads its values back at its tokens' packed
  indices (batch.py); past a row's end it reads a meaningless value that every loss masks.
  """
  model = policy_model(graphdef, params, frozen)
  shared = batch.shared
  if batch.context_spans is not None:
    return _window_by_window(model, batch, loss, value_head, dropout_key)
  if shared is None:
    inputs, targets, _ = batch.inputs_and_targets()
    hidden, _ = model.hidden_states(inputs, dropout_key=dropout_key)
  else:
    inputs, targets = shared.tokens, shared.targets
    hidden, _ = model.hidden_states(inputs, shared.positions, segment_ids=shared.segments,
                                    shared_prompt=True, dropout_key=dropout_key)
  outputs = _project(model, hidden, targets, loss, value_head)
  return outputs if shared is None else tuple(map(shared.unpack, outputs))


def _project(model: Decoder, hidden: Array, targets: Array, loss: LossConfig,
             value_head: ValueHead | None) -> tuple[Array, Array, Array]:
  """(logprobs, entropies, values) [B, L] of the targets from the hidden states [B, L, E]."""
  head = model.unembedding()
  rows, length = targets.shape
  logprobs, entropies = rl.chunked_token_logprobs_and_entropy(
      hidden, targets, head.weight, vocab_major=head.vocab_major, dtype=head.dtype,
      chunk_size=min(loss.logprob_chunk, length),
      block_size=max(1, loss.logprob_block_tokens // rows) if loss.logprob_block_tokens else None,
      temperature=loss.temperature)
  values = value_head(hidden) if value_head is not None else jnp.zeros_like(logprobs)
  return logprobs, entropies, values


def _window_by_window(model: Decoder, batch: Batch, loss: LossConfig, value_head: ValueHead | None,
                      dropout_key: Array | None) -> tuple[Array, Array, Array]:
  """`token_logprobs` of rows of several contexts (batch.py): window w of every row (a run of
  whole contexts) is cut out as a row of batch.context_window tokens, each context in it
  attending within itself at positions from 0, and the windows run one after another, each
  recomputed in the backward pass (jax.checkpoint), so activations are those of one window per
  row. A window no row has is skipped. Each token's values are read back from its window."""
  tokens, contexts, spans = batch.tokens, batch.contexts, batch.context_spans
  window = batch.context_window
  rows, length = tokens.shape
  offsets = jnp.arange(window, dtype=jnp.int32)

  @jax.checkpoint
  def one_window(args):
    number, starts, sizes = args  # [N] starts and lengths of each row's window
    index = jnp.minimum(starts[:, None] + offsets, length - 2)
    inside = offsets < sizes[:, None]
    inputs = jnp.where(inside, jnp.take_along_axis(tokens, index, axis=1), 0)
    targets = jnp.where(inside, jnp.take_along_axis(tokens, index + 1, axis=1), 0)
    segments = jnp.where(inside, jnp.take_along_axis(contexts, index, axis=1), -1)
    key = None if dropout_key is None else jax.random.fold_in(dropout_key, number)

    def run():
      hidden, _ = model.hidden_states(inputs, _segment_positions(segments), segment_ids=segments,
                                      dropout_key=key)
      return _project(model, hidden, targets, loss, value_head)

    skip = lambda: tuple(jnp.zeros((rows, window), jnp.float32) for _ in range(3))
    return jax.lax.cond(jnp.any(sizes > 0), run, skip)

  count = spans.shape[1]
  windows = jax.lax.map(one_window, (jnp.arange(count), spans[..., 0].T, spans[..., 1].T))
  # Input t of row n is token t - start of the last window starting at or before it.
  t = jnp.arange(length - 1, dtype=jnp.int32)
  number = jnp.sum(spans[:, None, :, 0] <= t[None, :, None], axis=-1) - 1
  starts = jnp.take_along_axis(spans[..., 0], jnp.maximum(number, 0), axis=1)
  flat = jnp.maximum(number, 0) * window + jnp.clip(t - starts, 0, window - 1)
  return tuple(
      jnp.take_along_axis(w.transpose(1, 0, 2).reshape(rows, count * window), flat, axis=1)
      for w in windows)


def _segment_positions(segments: Array) -> Array:
  """Each token's position in its own segment: its index minus that of its segment's first
  token, for segment ids [N, L] that change only between segments."""
  index = jnp.arange(segments.shape[1], dtype=jnp.int32)
  starts = jnp.concatenate(
      [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def policy_model(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None) -> Decoder:
  """The learner's model: the Decoder of `params`, or with LoRA's frozen base the LoraModel
  whose adapters are `params` (the base gets no gradient: it is not differentiated)."""
  if frozen is None:
    return nnx.merge(graphdef, params)
  return nnx.merge(graphdef, params, frozen)


def micro_batches(tree: Any, micro_batch_rows: int) -> Any:
  """Splits every [M, ...] array of `tree` into [n, micro_batch_rows, ...] micro-batches, the
  j-th holding rows j, j + n, j + 2n, ... (n = M / micro_batch_rows)."""

  def split(x):
    n = x.shape[0] // micro_batch_rows
    return x.reshape(micro_batch_rows, n, *x.shape[1:]).swapaxes(0, 1)

  return jax.tree.map(split, tree)


def join_micro_batches(tree: Any) -> Any:
  """The inverse of `micro_batches`."""
  return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def split_micro_batches(batch: Batch, per_row: Any, micro_batch_rows: int):
  """(micro-batches of (batch, per_row), join): `micro_batches` of a batch and of a tree of
  per-row arrays [M, ...]; join maps per-row outputs [n, micro_batch_rows, ...] back to [M, ...].

  In the shared-prompt layout micro-batch j holds packed rows j, j + n, j + 2n, ... and the
  samples that read them, so every group stays whole; each micro-batch then needs
  micro_batch_rows samples (groups of one size, as a rollout's; config.py checks it).
  """
  shared = batch.shared
  if shared is None:
    return micro_batches((batch, per_row), micro_batch_rows), join_micro_batches
  count = shared.rows.shape[0] // micro_batch_rows
  order = jnp.argsort(shared.rows % count, stable=True)
  restore = jnp.argsort(order)
  take = lambda x: x[order].reshape(count, micro_batch_rows, *x.shape[1:])
  # Packed row g = j + k * count is row k of micro-batch j.
  tokens, targets, positions, segments = micro_batches(
      (shared.tokens, shared.targets, shared.positions, shared.segments),
      shared.tokens.shape[0] // count)
  packed = SharedPrompts(tokens=tokens, targets=targets, positions=positions, segments=segments,
                         rows=take(shared.rows) // count, index=take(shared.index))
  parts = jax.tree.map(take, (batch.replace(shared=None), per_row))
  join = lambda tree: jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[restore], tree)
  return (parts[0].replace(shared=packed), parts[1]), join


def _splits(rows: int, loss: LossConfig) -> bool:
  return 0 < loss.micro_batch_rows < rows


def _micro_token_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, loss: LossConfig,
                          value_head: ValueHead | None = None,
                          frozen: nnx.State | None = None) -> tuple[Array, Array, Array]:
  """`token_logprobs`, micro-batch by micro-batch when loss.micro_batch_rows splits the batch."""
  if not _splits(batch.tokens.shape[0], loss):
    return token_logprobs(graphdef, params, batch, loss, value_head, frozen)
  (parts, _), join = split_micro_batches(batch, (), loss.micro_batch_rows)
  return join(
      jax.lax.map(lambda b: token_logprobs(graphdef, params, b, loss, value_head, frozen), parts))


@functools.partial(jax.jit, static_argnames=("loss", "num_groups", "num_turns"))
def compute_experience(networks: Networks, trainable: tuple[nnx.State, nnx.State | None],
                       ref_params: nnx.State | None, batch: Batch, *, loss: LossConfig,
                       num_groups: int, num_turns: int = 0) -> tuple[Experience, dict[str, Array]]:
  """Old and reference log-probs, values, advantages and the rollout correction for one rollout
  batch, from the trainable (policy, value head or None); its metrics include the
  sampler-learner mismatch of the first `num_turns` turns and, for an estimator of turn-level
  credit (GiGPO), its step groups (`rl.step_group_metrics`). With LoRA's frozen base, the
  policy's and the reference's parameters are adapters."""
  params, value_params = trainable
  graphdef, frozen = networks.graphdef, networks.frozen
  old_logprobs, entropies, old_values = _micro_token_logprobs(graphdef, params, batch, loss,
                                                              networks.value_head(value_params),
                                                              frozen)
  _, _, mask = batch.inputs_and_targets()
  if loss.uses_reference:
    ref_logprobs, _, _ = _micro_token_logprobs(graphdef, ref_params, batch, loss, frozen=frozen)
  else:
    ref_logprobs = jnp.zeros_like(old_logprobs)
  token_rewards = None
  if loss.kl_in_reward_coef > 0:
    token_rewards = rl.kl_penalty_rewards(old_logprobs, ref_logprobs, mask,
                                          beta=loss.kl_in_reward_coef,
                                          estimator=loss.kl_in_reward_estimator)
  estimator = rl.get_advantage_estimator(loss.advantage_estimator)
  inputs: dict[str, Any] = dict(loss.advantage_options, token_rewards=token_rewards)
  if estimator.needs_groups:
    inputs.update(group_ids=batch.group_ids, num_groups=num_groups)
  if estimator.needs_values:
    inputs["values"] = old_values
  turns = dict(turn_index=None if batch.turn_index is None else batch.turn_index[:, 1:],
               turn_rewards=batch.turn_rewards, turn_anchors=batch.turn_anchors)
  inputs.update({k: v for k, v in turns.items() if k in estimator.needs + estimator.accepts})
  advantages, returns = estimator(batch.rewards, mask, **inputs)
  advantages = rl.weight_negatives(advantages, loss.negative_advantage_weight)
  # The importance-sampling check: how far the sampler's log-probs are from the learner's.
  sampler_logprobs = batch.sampler_logprobs[:, 1:]
  correction, correction_metrics = rl.rollout_correction(old_logprobs, sampler_logprobs, mask,
                                                         method=loss.rollout_correction,
                                                         cap=loss.rollout_correction_cap)
  gap = jnp.abs(sampler_logprobs - old_logprobs)
  metrics = {
      **correction_metrics,
      **rl.mismatch_metrics(old_logprobs, sampler_logprobs, mask, num_turns=num_turns),
      "logprob_gap_mean":
          rl.masked_mean(gap, mask),
      "logprob_gap_max":
          jnp.max(jnp.where(mask > 0, gap, 0.0)),
      "entropy":
          rl.masked_mean(entropies, mask),
      "advantage_mean":
          rl.masked_mean(advantages, mask),
      "kl_to_ref":
          rl.masked_mean(rl.kl_divergence(old_logprobs, ref_logprobs, "low_var_kl"), mask)
          if loss.uses_reference else jnp.zeros(()),
  }
  if estimator.needs_turns:
    metrics.update({f"gigpo/{k}": v for k, v in rl.step_group_metrics(batch.turn_anchors).items()})
  return Experience(old_logprobs, ref_logprobs, old_values, advantages, returns, correction.weights,
                    correction.kept), metrics


# fold_in of an update's key that a drawing policy loss (Clip-Cov) draws from; the model's
# dropout folds in layer numbers, far below it.
CHOICE_STREAM = 1 << 24


def _loss_fn(trainable: tuple[nnx.State, nnx.State | None], networks: Networks, batch: Batch,
             experience: Experience, loss: LossConfig, key: Array | None = None,
             on_policy: Array | None = None) -> tuple[Array, dict[str, Array]]:
  params, value_params = trainable
  logprobs, entropies, values = token_logprobs(networks.graphdef, params, batch, loss,
                                               networks.value_head(value_params), networks.frozen,
                                               key)
  old_logprobs = experience.old_logprobs
  if on_policy is not None:
    # The parameters are the experience pass's, so the old log-probs are these very log-probs:
    # taken from this forward pass, the ratio is exactly 1. The experience pass's own forward
    # is compiled apart (no gradient, no remat) and its fusions round differently: with bf16
    # matmul inputs its log-probs differ by up to ~1e-3 here (more on some CPUs), which would
    # clip tokens of a batch no update has touched yet.
    old_logprobs = jnp.where(on_policy, jax.lax.stop_gradient(logprobs), old_logprobs)
  _, _, mask = batch.inputs_and_targets()
  # Trajectories the rollout correction dropped count in no term of the loss.
  mask = mask * experience.kept[:, None]
  aggregation = dict(aggregation=loss.aggregation, scale_tokens=loss.loss_scale_tokens)
  policy_loss = rl.get_policy_loss(loss.policy_loss)
  options: dict[str, Any] = dict(loss.policy_loss_options)
  if policy_loss.clip_keys is not None:
    options["clip"] = rl.Clip(loss.clip_eps_low, loss.clip_eps_high,
                              loss.dual_clip_c if policy_loss.dual_clip else None)
  if policy_loss.draws:
    if key is None:
      raise ValueError(f"policy loss {loss.policy_loss!r} draws tokens at random: it needs a key")
    options["key"] = jax.random.fold_in(key, CHOICE_STREAM)
  total, metrics = policy_loss.fn(logprobs, old_logprobs, experience.advantages, mask, **options,
                                  **aggregation, importance_weights=experience.rollout_weights)
  metrics = {f"policy/{k}": v for k, v in metrics.items()}
  metrics["policy/loss"] = total
  if loss.kl_coef > 0:
    kl, _ = rl.kl_loss(logprobs, experience.ref_logprobs, mask, estimator=loss.kl_estimator,
                       **aggregation)
    total = total + loss.kl_coef * kl
    metrics["kl_loss"] = kl
  if loss.entropy_coef > 0:
    entropy, _ = rl.entropy_bonus(entropies, mask, **aggregation)
    total = total - loss.entropy_coef * entropy
  if loss.uses_critic:
    value_loss, value_metrics = rl.value_loss(values, experience.old_values, experience.returns,
                                              mask, clip_eps=loss.value_clip_eps, **aggregation)
    total = total + loss.value_coef * value_loss
    metrics.update({f"value/{k}": v for k, v in value_metrics.items()})
    metrics["value/loss"] = value_loss
  metrics["loss"] = total
  return total, metrics


UPDATE_STATIC_ARGNAMES = ("optimizer", "loss")


def jit_update_step(state_shardings: UpdateState):
  """`update_step` compiled so that parameters and optimizer state keep their shardings, their
  buffers donated.

  Without out_shardings the compiler may return updated parameters in any layout it likes, and
  over many steps the state drifts away from the mesh's logical rules.
  """
  return jax.jit(update_step, static_argnames=UPDATE_STATIC_ARGNAMES, donate_argnames="state",
                 out_shardings=(state_shardings, None))


def update_step(networks: Networks, state: UpdateState, batch: Batch, experience: Experience, *,
                optimizer: optax.GradientTransformation, loss: LossConfig, key: Array | None = None,
                on_policy: Array | None = None) -> tuple[UpdateState, dict[str, Array]]:
  """One optimizer step on one minibatch. Returns (state, metrics).

  `key` is the update's randomness (LoRA's dropout, a drawing policy loss's choice of tokens),
  None when nothing draws. `on_policy` (a bool scalar) says that the state's trainable are the
  parameters the experience was computed with (a step's first minibatch): the loss then takes
  its old log-probs from its own forward pass, so that its ratio is exactly 1 (`_loss_fn`).
  With LoRA, trainable[0] are the adapters over the networks' frozen base (module
  docstring)."""
  grads, metrics = _gradients(state.trainable, networks, batch, experience, loss, key, on_policy)
  return _apply(state, grads, optimizer, metrics)


# How micro-batches combine the update's metrics: losses (keys ending in "loss") as the loss
# does, by each part's share of the aggregation's units; maxima over tokens by max; the others,
# means over trained tokens, by each part's share of the tokens.
MAX_METRICS = ("policy/ratio_max",)


def _gradients(trainable: tuple[nnx.State, nnx.State | None], networks: Networks, batch: Batch,
               experience: Experience, loss: LossConfig, key: Array | None = None,
               on_policy: Array | None = None) -> tuple[Any, dict[str, Array]]:
  """(gradient of the minibatch's loss, its metrics), accumulated over micro-batches when
  loss.micro_batch_rows splits the minibatch (the module docstring's weighting); micro-batch j
  draws with fold_in(key, j)."""
  grad_fn = jax.value_and_grad(functools.partial(_loss_fn, on_policy=on_policy), has_aux=True)
  if not _splits(batch.tokens.shape[0], loss):
    (_, metrics), grads = grad_fn(trainable, networks, batch, experience, loss, key)
    return grads, metrics
  # The loss's mask: trained tokens of the trajectories the rollout correction keeps.
  mask = lambda b, e: b.inputs_and_targets()[2] * e.kept[:, None]
  units = lambda b, e: rl.aggregation_units(mask(b, e), loss.aggregation)
  tokens = lambda b, e: rl.aggregation_units(mask(b, e), "token-mean")
  total_units = jnp.maximum(units(batch, experience), 1.0)
  total_tokens = jnp.maximum(tokens(batch, experience), 1.0)

  def accumulate(carry, micro):
    (micro_batch, micro_experience), index = micro
    micro_key = None if key is None else jax.random.fold_in(key, index)
    (_, metrics), grads = grad_fn(trainable, networks, micro_batch, micro_experience, loss,
                                  micro_key)
    share = units(micro_batch, micro_experience) / total_units
    token_share = tokens(micro_batch, micro_experience) / total_tokens
    sums, maxima = carry
    grads = jax.tree.map(lambda total, x: total + share * x, sums[0], grads)
    means = {
        k: total + (share if k.endswith("loss") else token_share) * metrics[k]
        for k, total in sums[1].items()
    }
    maxima = {k: jnp.maximum(maxima[k], metrics[k]) for k in maxima}
    return ((grads, means), maxima), None

  parts, _ = split_micro_batches(batch, experience, loss.micro_batch_rows)
  shapes = jax.eval_shape(lambda b, e: grad_fn(trainable, networks, b, e, loss, key),
                          *jax.tree.map(lambda x: x[0], parts))
  (_, metric_shapes), grad_shapes = shapes
  zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)
  sums = (zeros(grad_shapes),
          zeros({k: v for k, v in metric_shapes.items() if k not in MAX_METRICS}))
  maxima = {k: jnp.full((), -jnp.inf) for k in metric_shapes if k in MAX_METRICS}
  indices = jnp.arange(batch.tokens.shape[0] // loss.micro_batch_rows)
  ((grads, metrics), maxima), _ = jax.lax.scan(accumulate, (sums, maxima), (parts, indices))
  return grads, {**metrics, **maxima}


def minibatch_indices(num_rows: int, num_minibatches: int, epochs: int, rng: np.random.Generator,
                      row_groups: np.ndarray | None = None) -> list[np.ndarray]:
  """Row indices of every minibatch of every epoch, reshuffled each epoch.

  With row_groups [num_rows] (the packed row of each sample, in the shared-prompt layout) the
  groups are shuffled and split instead, a minibatch's rows coming group by group, so that a
  group's prompt is computed once in its minibatch; every minibatch must hold as many rows.
  """
  if row_groups is None:
    units = [np.asarray([row]) for row in range(num_rows)]
  else:
    units = [np.flatnonzero(row_groups == group) for group in dict.fromkeys(row_groups.tolist())]
  if len(units) % num_minibatches:
    what = "trajectories" if row_groups is None else "groups"
    raise ValueError(f"{len(units)} {what} do not split into {num_minibatches} minibatches")
  size = len(units) // num_minibatches
  order = []
  for _ in range(epochs):
    permutation = rng.permutation(len(units))
    order.extend(
        np.concatenate([units[u] for u in permutation[i * size:(i + 1) * size]])
        for i in range(num_minibatches))
  if len({len(rows) for rows in order}) > 1:
    raise ValueError("the groups do not split into minibatches of one size: "
                     f"{sorted({len(rows) for rows in order})} rows")
  return order


def take_rows(tree: Any, rows: np.ndarray) -> Any:
  """Rows `rows` of every array of `tree` (a Batch in the shared-prompt layout: `take_batch`)."""
  return _take_rows(tree, np.asarray(rows))


@jax.jit
def _take_rows(tree: Any, rows: Array) -> Any:
  """`take_rows` as one compiled program. Indexing each array eagerly dispatches a program per
  array (several per index), and on XLA:CPU a mesh that spans devices runs each as a collective
  program: many small ones in flight at once deadlocked a loaded 2-core host."""
  return jax.tree.map(lambda x: x[rows], tree)


@jax.jit
def _take_shared(shared: SharedPrompts, rows: Array, packed: Array) -> SharedPrompts:
  """`take_batch`'s packed rows packed[i] (empty where packed[i] < 0) and the index of the samples
  `rows`, in one program; `rows` [N] of the result are still the whole batch's."""
  real = (packed >= 0)[:, None]
  gather = lambda x, fill: jnp.where(real, x[jnp.maximum(packed, 0)], fill)
  return shared.replace(tokens=gather(shared.tokens, 0), targets=gather(shared.targets, 0),
                        positions=gather(shared.positions, 0), segments=gather(shared.segments, -1),
                        index=shared.index[rows])


def take_batch(batch: Batch, rows: np.ndarray, row_groups: np.ndarray | None = None,
               rows_multiple: int = 1) -> Batch:
  """Rows `rows` of a batch. In the shared-prompt layout row_groups [N] (a host copy of
  batch.shared.rows) names the packed rows they read: those are taken too, in order of first
  use, and padded with empty packed rows to a multiple of `rows_multiple` (the mesh's batch
  shards)."""
  taken = take_rows(batch.replace(shared=None), rows)
  shared = batch.shared
  if shared is None:
    return taken
  used = list(dict.fromkeys(row_groups[rows].tolist()))
  packed = np.asarray(used + [-1] * (-len(used) % rows_multiple))
  local = {group: i for i, group in enumerate(used)}
  local_rows = np.asarray([local[g] for g in row_groups[rows].tolist()], np.int32)
  return taken.replace(shared=_take_shared(shared, rows, packed).replace(rows=local_rows))


# --- the offline updates: SFT and DPO (offline.py's loop) ----------------------------------


def sft_objective(params: nnx.State, networks: Networks, batch: Batch, loss: LossConfig,
                  dropout_key: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """The token-mean NLL of the reply tokens: sum m (-log pi(y_t | y_<t)) / sum m, with m = 1
  exactly on the assistant reply tokens (and the turn end closing each reply)."""
  logprobs, _, _ = token_logprobs(networks.graphdef, params, batch, loss, None, networks.frozen,
                                  dropout_key)
  _, _, mask = batch.inputs_and_targets()
  nll, out = rl.sft_loss(logprobs, mask, aggregation="token-mean")
  out["trained_tokens"] = jnp.sum(mask)
  return nll, out


def policy_sequence_logprobs(networks: Networks, params: nnx.State, batch: Batch, loss: LossConfig,
                             dropout_key: Array | None = None) -> Array:
  """f32[N]: log pi(y) summed over each row's reply tokens."""
  logprobs, _, _ = token_logprobs(networks.graphdef, params, batch, loss, None, networks.frozen,
                                  dropout_key)
  _, _, mask = batch.inputs_and_targets()
  return rl.sequence_logprobs(logprobs, mask)


@functools.partial(jax.jit, static_argnames=("loss",))
def reference_logprobs(networks: Networks, ref_params: nnx.State, pairs: Batch, *,
                       loss: LossConfig) -> Array:
  """f32[2B]: the frozen reference's sequence log-probs of chosen-then-rejected rows."""
  return policy_sequence_logprobs(networks, ref_params, pairs, loss)


def dpo_objective(params: nnx.State, networks: Networks, pairs: Batch, ref_logprobs: Array,
                  loss: LossConfig, beta: float,
                  dropout_key: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """The DPO loss of chosen-then-rejected rows (offline.stack_pairs): the mean over pairs of
  -log sigmoid(beta (log pi(y_w) - log pi_ref(y_w)) - beta (log pi(y_l) - log pi_ref(y_l)))."""
  policy = policy_sequence_logprobs(networks, params, pairs, loss, dropout_key)
  num_pairs = policy.shape[0] // 2
  value, out = rl.dpo_loss(policy[:num_pairs], policy[num_pairs:], ref_logprobs[:num_pairs],
                           ref_logprobs[num_pairs:], beta=beta)
  out["chosen_logprob"] = jnp.mean(policy[:num_pairs])
  out["rejected_logprob"] = jnp.mean(policy[num_pairs:])
  return value, out


def _apply(state: UpdateState, grads: Any, optimizer: optax.GradientTransformation,
           metrics: dict[str, Array]) -> tuple[UpdateState, dict[str, Array]]:
  """The optimizer step of `grads` on `state`; metrics gain the gradient's norm and the count
  of non-finite steps skipped."""
  metrics["grad_norm"] = optax.global_norm(grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
  metrics["nonfinite_steps"] = opt_state.notfinite_count
  return UpdateState(optax.apply_updates(state.trainable, updates), opt_state), metrics


def sft_step(networks: Networks, state: UpdateState, batch: Batch, dropout_key: Array | None, *,
             optimizer: optax.GradientTransformation,
             loss: LossConfig) -> tuple[UpdateState, dict[str, Array]]:
  """One SFT optimizer step. Returns (state, metrics)."""
  (value, out), grads = jax.value_and_grad(sft_objective, has_aux=True)(state.trainable, networks,
                                                                        batch, loss, dropout_key)
  out["loss"] = value
  return _apply(state, grads, optimizer, out)


def dpo_step(networks: Networks, state: UpdateState, pairs: Batch, ref_logprobs: Array,
             dropout_key: Array | None, *, optimizer: optax.GradientTransformation,
             loss: LossConfig, beta: float) -> tuple[UpdateState, dict[str, Array]]:
  """One DPO optimizer step on chosen-then-rejected rows. Returns (state, metrics)."""
  (value, out), grads = jax.value_and_grad(dpo_objective,
                                           has_aux=True)(state.trainable, networks, pairs,
                                                         ref_logprobs, loss, beta, dropout_key)
  out["loss"] = value
  return _apply(state, grads, optimizer, out)
