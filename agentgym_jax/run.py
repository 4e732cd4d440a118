"""What every training loop shares: the policy and its sampler, the optimizer, the state and its
shardings, checkpoint resume, health checks, phase timing and the export.

The RL loop (trainer.py) and the offline loop (offline.py) sit side by side on top of this
module; neither imports the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentgym_jax import checkpoint, config as config_lib, horizon, learner, rl, rollout
from agentgym_jax import sharding
from agentgym_jax.models import Decoder, load_model, weights
from agentgym_jax.models.tokenizer import Tokenizer
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool


# --- the settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a run derives from its config, built and validated once (`from_config`) and handed
  to the loops, which read the config's plain values through `c` but derive nothing from it.

  Attributes:
    c: the validated config.
    schedule: the ScalingInter-RL horizon schedule (the turn cap of every step).
    sampling: how rollout turns are sampled.
    eval_sampling, eval_horizon: how evaluation turns are sampled, and its turn cap
      (eval.horizon, or the schedule's largest cap).
    optimizer: AdamW over the run's optimizer updates.
    loss: the static loss settings compiled into the update (offline modes read only the
      log-prob chunk and score the model's own distribution, temperature 1).
    rows: trajectories per RL step (tasks_per_step x samples_per_task).
  """

  c: ml_collections.ConfigDict
  schedule: horizon.HorizonSchedule
  sampling: rollout.TurnSampling
  eval_sampling: rollout.TurnSampling
  eval_horizon: int
  optimizer: optax.GradientTransformation
  loss: learner.LossConfig
  rows: int

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> Settings:
    c = config_lib.validate(c)
    schedule = horizon.make_horizon_schedule(config_lib.horizon_options(c))
    turn = functools.partial(rollout.TurnSampling, max_new_tokens=c.rollout.max_new_tokens,
                             top_p=c.rollout.top_p, top_k=c.rollout.top_k)
    return cls(c=c, schedule=schedule, sampling=turn(temperature=c.rollout.temperature),
               eval_sampling=turn(temperature=c.eval.temperature),
               eval_horizon=c.eval.horizon or schedule.max_turns, optimizer=make_optimizer(c),
               loss=_loss_config(c), rows=c.rollout.tasks_per_step * c.rollout.samples_per_task)

  def check_layout(self, mesh: Mesh, process_count: int) -> None:
    """What the config can only be checked against once the mesh and processes are known."""
    c = self.c
    process_rows = self.rows // process_count
    if process_rows % c.rollout.pipeline_groups:
      raise config_lib.ConfigError(
          f"invalid config: rollout.pipeline_groups={c.rollout.pipeline_groups} does not divide "
          f"the {process_rows} trajectories of each of the {process_count} processes")
    batch_shards = math.prod(mesh.shape[axis] for axis in sharding.BATCH)
    minibatch = self.rows // c.algorithm.num_minibatches
    if minibatch % batch_shards:
      raise config_lib.ConfigError(
          f"invalid config: a minibatch of {minibatch} trajectories (tasks_per_step x "
          f"samples_per_task / num_minibatches) does not split over the {batch_shards} devices "
          "of the mesh's data x fsdp axes; change the batch or mesh.data/mesh.fsdp")


def _loss_config(c: ml_collections.ConfigDict) -> learner.LossConfig:
  a = c.algorithm
  if c.mode != "rl":
    return learner.LossConfig(logprob_chunk=a.logprob_chunk)
  estimator = rl.get_advantage_estimator(a.advantage)
  options = sorted((argument, a[key]) for argument, key in estimator.hyperparameters)
  return learner.LossConfig(
      advantage_estimator=a.advantage, advantage_options=tuple(options),
      clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
      dual_clip_c=a.dual_clip_c or None, aggregation=a.aggregation, kl_coef=a.kl_coef,
      kl_estimator=a.kl_estimator, kl_in_reward_coef=a.kl_in_reward_coef,
      kl_in_reward_estimator=a.kl_in_reward_estimator,
      entropy_coef=a.entropy_coef, value_coef=a.value_coef, value_clip_eps=a.value_clip_eps,
      temperature=c.rollout.temperature, logprob_chunk=a.logprob_chunk)


# --- the policy ----------------------------------------------------------------------------


def load_policy(c: ml_collections.ConfigDict, model_name: str | None = None
                ) -> tuple[Mesh, Decoder, Tokenizer]:
  """(mesh, model, tokenizer): the policy loaded sharded on the configured mesh."""
  sharding.initialize_distributed()
  mesh = sharding.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
  model, tokenizer = load_model(model_name or c.model.name, dtype=jnp.dtype(c.model.dtype),
                                param_dtype=jnp.dtype(c.model.param_dtype),
                                remat=c.model.remat, mesh=mesh)
  return mesh, model, tokenizer


def make_sampler(c: ml_collections.ConfigDict, model: Decoder, mesh: Mesh | None, rows: int
                 ) -> Sampler:
  """The sampler for playing `rows` episodes at once: rows / rollout.pipeline_groups rows of
  rollout.max_context slots each (every group of rows has its own state on it), the KV cache
  in rollout.cache_dtype."""
  return Sampler(model, cache_slots=c.rollout.max_context,
                 max_batch=-(-rows // c.rollout.pipeline_groups),
                 cache_dtype=c.rollout.cache_dtype or None, mesh=mesh)


def eval_tasks(c: ml_collections.ConfigDict, pool: EnvPool) -> list[int]:
  """The evaluation's tasks: eval.split of the pool's environment, the first eval.max_tasks."""
  task_ids = list(pool.task_ids(c.eval.split))
  return task_ids[:c.eval.max_tasks] if c.eval.max_tasks else task_ids


# --- the optimizer and the state -----------------------------------------------------------


def learning_rate_schedule(c: ml_collections.ConfigDict) -> optax.Schedule:
  """optim.schedule over the run's optimizer updates (config.optimizer_updates)."""
  o = c.optim
  if o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, max(o.warmup_steps, 1),
                                              config_lib.optimizer_updates(c))
  if o.warmup_steps:
    return optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
  return optax.constant_schedule(o.learning_rate)


def make_optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The run's optimizer from config.optim (AdamW after clipping, non-finite steps skipped)."""
  return learner.make_optimizer(
      learning_rate_schedule(c), weight_decay=c.optim.weight_decay, b1=c.optim.b1,
      b2=c.optim.b2, eps=c.optim.eps, grad_clip=c.optim.grad_clip,
      max_consecutive_nonfinite=c.optim.max_consecutive_nonfinite)


@dataclasses.dataclass
class RunState:
  """What a checkpoint restores: the trained parameters and the optimizer state."""

  params: nnx.State
  value_params: nnx.State | None
  opt_state: optax.OptState

  def tree(self) -> dict[str, Any]:
    return {"params": self.params, "value_params": self.value_params,
            "opt_state": self.opt_state}


def state_shardings(trainable: Any, opt_state: Any, mesh: Mesh) -> tuple[Any, Any]:
  """(trainable shardings, optimizer-state shardings): each trained array where the model
  loader put it (the logical-axis rules; arrays not yet on the mesh, such as a new value head,
  replicated), each optimizer moment like its array, counters replicated.

  The update step returns its state with exactly these shardings; left to itself, jit gives
  the optimizer's moments no sharding (a replicated copy of every moment on every device) and
  XLA's propagation may choose others between steps, which moves the state and compiles the
  update a second time. `opt_state` may be abstract (jax.eval_shape of the optimizer's init).
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  on_mesh = lambda x: (x.sharding if isinstance(x.sharding, NamedSharding)
                       and x.sharding.mesh == mesh else replicated)
  trainable_shardings = jax.tree.map(on_mesh, trainable)
  structure = jax.tree.structure(trainable)
  like_trainable = lambda subtree: jax.tree.structure(subtree) == structure
  opt_shardings = jax.tree.map(
      lambda x: trainable_shardings if like_trainable(x) else replicated, opt_state,
      is_leaf=like_trainable)
  return trainable_shardings, opt_shardings


def resume(checkpointer: checkpoint.Checkpointer, state: RunState
           ) -> tuple[RunState, int, dict[str, Any]]:
  """(state, first step to run, checkpoint meta) from the newest complete checkpoint, or the
  given state at step 0. Step k's checkpoint is written after k steps."""
  if checkpointer.latest_step() is None:
    return state, 0, {}
  restored, meta = checkpointer.restore(state.tree())
  logging.info("resumed from step %d", int(meta["step"]))
  return (RunState(restored["params"], restored["value_params"], restored["opt_state"]),
          int(meta["step"]), meta)


# --- each step ----------------------------------------------------------------------------


class PhaseTimer:
  """Wall time per named phase of a step: `with timer("update"): ...`."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, name: str):
    start = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def check_health(fetched: dict[str, Any], c: ml_collections.ConfigDict) -> None:
  """Stops the run with a clear message when the numbers say it is broken."""
  if fetched.get("nonfinite_steps", 0) >= c.optim.max_consecutive_nonfinite:
    raise FloatingPointError(
        f"{int(fetched['nonfinite_steps'])} consecutive updates had non-finite gradients; "
        f"stopping (optim.max_consecutive_nonfinite={c.optim.max_consecutive_nonfinite})")
  gap = fetched.get("logprob_gap_mean")
  if gap is not None and gap > c.rollout.max_logprob_gap:
    raise RuntimeError(
        f"the sampler's and the learner's log-probs differ by {gap:.3g} nats per token on "
        f"average (> rollout.max_logprob_gap={c.rollout.max_logprob_gap}): the sampled "
        "tokens are no longer on-policy")


# --- the end ------------------------------------------------------------------------------


def export_policy(c: ml_collections.ConfigDict, model: Decoder, tokenizer: Tokenizer,
                  workdir: pathlib.Path) -> None:
  """The trained policy as a Hugging Face directory, workdir/export, if checkpoint.export_hf."""
  if c.checkpoint.export_hf:
    weights.save_hf(model, workdir / "export", dtype=c.checkpoint.export_dtype)
    tokenizer.save_pretrained(workdir / "export")
