"""The RL train loop: rollout -> experience -> update, one step at a time.

Everything random derives from (config.seed, step): the rollout key is fold_in(seed key, step),
the minibatch order is seeded with (seed, step), and the task order is a per-epoch permutation
seeded with (seed, epoch). A resumed run therefore needs only the checkpointed step (plus the
parameters and optimizer state) to continue exactly as an uninterrupted run would.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentgym_jax import checkpoint, config as config_lib, evaluation, horizon, learner, metrics
from agentgym_jax import multihost, rl, rollout
from agentgym_jax import sharding
from agentgym_jax.models import Decoder, load_model, weights
from agentgym_jax.sampling import Sampler
from environments.pool import EnvPool


def load_policy(c: ml_collections.ConfigDict, model_name: str | None = None):
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


def eval_settings(c: ml_collections.ConfigDict, schedule: horizon.HorizonSchedule
                  ) -> tuple[rollout.TurnSampling, int]:
  """How evaluation samples (eval.temperature, the rollout's other settings) and its turn cap."""
  sampling = rollout.TurnSampling(max_new_tokens=c.rollout.max_new_tokens,
                                  temperature=c.eval.temperature, top_p=c.rollout.top_p,
                                  top_k=c.rollout.top_k)
  return sampling, c.eval.horizon or schedule.max_turns


def eval_tasks(c: ml_collections.ConfigDict, pool: EnvPool) -> list[int]:
  task_ids = list(pool.task_ids(c.eval.split))
  return task_ids[:c.eval.max_tasks] if c.eval.max_tasks else task_ids


def eval_metrics(summary: dict[str, Any]) -> dict[str, float]:
  """Flat metrics of an evaluation summary: eval/success (Avg@k), eval/pass@k, per category."""
  out = {"eval/success": summary["avg@k"], "eval/pass@k": summary["pass@k"],
         "eval/turns": summary["turns"]}
  for name, stats in summary["categories"].items():
    out[f"eval/success/{name}"] = stats["avg@k"]
  return out


class TaskOrder:
  """An endless, reproducible stream of training task ids: a new permutation every epoch."""

  def __init__(self, task_ids: Sequence[int], seed: int):
    if not task_ids:
      raise ValueError("the environment's train split is empty")
    self.task_ids = np.asarray(task_ids)
    self.seed = seed

  def take(self, cursor: int, count: int) -> list[int]:
    """The `count` tasks starting at position `cursor` of the stream."""
    n = len(self.task_ids)
    out = []
    for position in range(cursor, cursor + count):
      epoch, index = divmod(position, n)
      permutation = np.random.default_rng([self.seed, epoch]).permutation(n)
      out.append(int(self.task_ids[permutation[index]]))
    return out


def learning_rate_schedule(c: ml_collections.ConfigDict) -> optax.Schedule:
  o = c.optim
  if o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, max(o.warmup_steps, 1),
                                              c.steps * c.algorithm.ppo_epochs
                                              * c.algorithm.num_minibatches)
  if o.warmup_steps:
    return optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
  return optax.constant_schedule(o.learning_rate)


def loss_config(c: ml_collections.ConfigDict) -> learner.LossConfig:
  a = c.algorithm
  estimator = rl.get_advantage_estimator(a.advantage)
  options = sorted((argument, a[key]) for argument, key in estimator.hyperparameters)
  return learner.LossConfig(
      advantage_estimator=a.advantage, advantage_options=tuple(options),
      clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
      dual_clip_c=a.dual_clip_c or None, aggregation=a.aggregation, kl_coef=a.kl_coef,
      kl_estimator=a.kl_estimator, kl_in_reward_coef=a.kl_in_reward_coef,
      entropy_coef=a.entropy_coef, value_coef=a.value_coef, value_clip_eps=a.value_clip_eps,
      temperature=c.rollout.temperature, logprob_chunk=a.logprob_chunk)


@dataclasses.dataclass
class RunState:
  """What a checkpoint restores: the trained parameters and the optimizer state."""

  params: nnx.State
  value_params: nnx.State | None
  opt_state: optax.OptState

  def tree(self) -> dict[str, Any]:
    return {"params": self.params, "value_params": self.value_params,
            "opt_state": self.opt_state}


def trajectory_records(trajectories: Sequence[rollout.Trajectory], advantages: jax.Array,
                       loss_mask: jax.Array) -> list[dict[str, Any]]:
  """The step's trajectory log records, each with its sample index within its group and its
  advantage: the mean over its trained tokens (GRPO's and RLOO's one value a row; a summary of
  GAE's per-token ones), None for a row without trained tokens (an excluded failed episode).

  advantages f32[N, T-1] are aligned with the targets, loss_mask f32[N, T] with the tokens.
  """
  mask = loss_mask[:, 1:]
  trained = jnp.sum(mask, axis=-1)
  row_advantage = jnp.sum(advantages * mask, axis=-1) / jnp.maximum(trained, 1.0)
  row_advantage, trained = multihost_utils.process_allgather((row_advantage, trained),
                                                             tiled=True)
  samples = collections.Counter()
  records = []
  for t, advantage, count in zip(trajectories, row_advantage.tolist(), trained.tolist()):
    records.append({**t.to_json(), "sample": samples[t.group],
                    "advantage": advantage if count else None})
    samples[t.group] += 1
  return records


def train(c: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> list[dict[str, Any]]:
  """Runs (or resumes) training in `workdir`; returns the per-step metrics of this call."""
  c = config_lib.validate(c)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  mesh, model, tokenizer = load_policy(c)
  chat = tokenizer.chat
  graphdef, params = nnx.split(model)
  loss = loss_config(c)
  ref_params = jax.tree.map(jnp.copy, params) if loss.uses_reference else None
  value_graphdef = value_params = None
  if loss.uses_critic:
    value_graphdef, value_params = nnx.split(learner.ValueHead(model.config.hidden_size))
  optimizer = learner.make_optimizer(
      learning_rate_schedule(c), weight_decay=c.optim.weight_decay, b1=c.optim.b1,
      b2=c.optim.b2, eps=c.optim.eps, grad_clip=c.optim.grad_clip,
      max_consecutive_nonfinite=c.optim.max_consecutive_nonfinite)
  opt_state = jax.jit(optimizer.init)((params, value_params))
  # Committed to the mesh, as the update's outputs will be: otherwise the first step's inputs
  # differ from the next steps' and every jitted function compiles twice. Leaves not already
  # laid out on the mesh (the value head, optimizer counters) are replicated over it.
  replicated = NamedSharding(mesh, PartitionSpec())
  on_mesh = lambda x: (x.sharding if isinstance(x.sharding, NamedSharding)
                       and x.sharding.mesh == mesh else replicated)
  shardings_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  value_params, opt_state = jax.device_put(
      (value_params, opt_state), jax.tree.map(on_mesh, (value_params, opt_state)))
  state = RunState(params, value_params, opt_state)
  update_step = learner.jit_update_step(shardings_of((params, value_params)),
                                        shardings_of(opt_state))

  # Resume from the newest complete checkpoint, if any. Steps count completed RL steps: the
  # checkpoint, metrics row and trajectory file of step k are written after k updates.
  checkpointer = checkpoint.Checkpointer(workdir / "checkpoints", keep=c.checkpoint.keep,
                                         save_every=c.checkpoint.every or c.steps)
  start_step = 0
  if checkpointer.latest_step() is not None:
    restored, meta = checkpointer.restore(state.tree())
    state = RunState(restored["params"], restored["value_params"], restored["opt_state"])
    start_step = int(meta["step"])
    logging.info("resumed from step %d", start_step)
  metrics_writer = metrics.MetricsWriter(workdir, tensorboard=c.log.tensorboard,
                                         defer_fetch=False, resume_step=start_step)
  trajectory_writer = metrics.TrajectoryWriter(workdir, resume_step=start_step)

  schedule = horizon.make_horizon_schedule(config_lib.horizon_options(c))
  num_rows = c.rollout.tasks_per_step * c.rollout.samples_per_task
  sampling = rollout.TurnSampling(max_new_tokens=c.rollout.max_new_tokens,
                                  temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                  top_k=c.rollout.top_k)
  # Each process plays its rows of the step on its own devices (all of them on one process).
  processes = multihost.Processes.of(mesh)
  process_rows = processes.rows(num_rows)
  if len(process_rows) % c.rollout.pipeline_groups:
    raise ValueError(f"invalid config: rollout.pipeline_groups={c.rollout.pipeline_groups} does "
                     f"not divide the {len(process_rows)} trajectories of each process")
  batch_shards = math.prod(mesh.shape[axis] for axis in sharding.BATCH)
  if (num_rows // c.algorithm.num_minibatches) % batch_shards:
    raise ValueError(
        f"invalid config: a minibatch of {num_rows // c.algorithm.num_minibatches} trajectories "
        f"(tasks_per_step x samples_per_task / num_minibatches) does not split over the "
        f"{batch_shards} devices of the mesh's data x fsdp axes; change the batch or "
        f"mesh.data/mesh.fsdp")
  sampler = make_sampler(c, model, processes.local_mesh, len(process_rows))
  eval_sampling, eval_horizon = eval_settings(c, schedule)
  base_key = jax.random.key(c.seed)
  eval_key = jax.random.fold_in(base_key, 1 << 30)  # Distinct from every step's fold_in.
  history = []
  with EnvPool(c.env.name, len(process_rows), options=c.env.options.to_dict(),
               backend=c.env.backend, step_timeout_s=c.env.step_timeout) as pool:
    tasks = TaskOrder(pool.task_ids("train"), c.seed)
    progress = metrics.ProgressBar(c.steps, keys=("reward", "success", "horizon_cap",
                                                  "time/rollout", "time/experience",
                                                  "time/update", "time/eval"),
                                   initial=start_step,
                                   enabled=None if c.log.progress_bar and processes.index == 0
                                   else False)
    for step in range(start_step, c.steps):
      timer = PhaseTimer()
      # 1. Rollout: B tasks x n samples, up to the current horizon cap.
      cap = schedule.cap(step)
      step_tasks = tasks.take(step * c.rollout.tasks_per_step, c.rollout.tasks_per_step)
      group_of = [(task_id, group) for group, task_id in enumerate(step_tasks)
                  for _ in range(c.rollout.samples_per_task)]
      with timer("rollout"):
        played, rollout_stats = rollout.collect(
            sampler, processes.local_copy(state.params), pool, chat,
            group_of[process_rows.start:process_rows.stop], horizon=cap, sampling=sampling,
            max_context=c.rollout.max_context, key=jax.random.fold_in(base_key, step),
            first_row=process_rows.start, groups=c.rollout.pipeline_groups)
        trajectories, rollout_stats = processes.gather_rollout(played, rollout_stats)

      # 2. Experience: old and reference log-probs, values, advantages.
      with timer("experience"):
        batch = rollout.pack(trajectories, failed_episodes=c.env.failed_episodes)
        batch = jax.device_put(batch, sharding.batch_sharding(mesh, 1))
        experience, experience_metrics = learner.compute_experience(
            graphdef, state.params, ref_params, value_graphdef, state.value_params, batch,
            loss=loss, num_groups=2 * num_rows)
        jax.block_until_ready(experience)  # So that the phase timers measure device work.

      # 3. Update: ppo_epochs passes of num_minibatches optimizer steps.
      with timer("update"):
        trainable, opt_state = (state.params, state.value_params), state.opt_state
        rng = np.random.default_rng([c.seed, step])
        update_metrics = []
        for rows in learner.minibatch_indices(num_rows, c.algorithm.num_minibatches,
                                              c.algorithm.ppo_epochs, rng):
          minibatch = learner.take_rows(batch, rows)
          trainable, opt_state, m = update_step(
              graphdef, value_graphdef, trainable, opt_state, minibatch,
              learner.take_rows(experience, rows), optimizer=optimizer, loss=loss)
          update_metrics.append(m)
        state = RunState(*jax.block_until_ready((trainable[0], trainable[1], opt_state)))

      done = step + 1
      step_metrics = _step_metrics(trajectories, rollout_stats, experience_metrics,
                                   update_metrics, cap, schedule.stage(step), timer)
      if c.eval.every and done % c.eval.every == 0:
        with timer("eval"):
          task_ids = eval_tasks(c, pool)
          _, played = evaluation.evaluate(
              sampler, processes.local_copy(state.params), pool, chat,
              processes.share(task_ids), samples_per_task=c.eval.samples_per_task,
              horizon=eval_horizon, sampling=eval_sampling, max_context=c.rollout.max_context,
              key=jax.random.fold_in(eval_key, done), rows_per_batch=len(process_rows),
              groups=c.rollout.pipeline_groups)
          summary = evaluation.summarize(processes.gather(played),
                                         evaluation.task_categories(pool, task_ids))
        step_metrics.update(eval_metrics(summary))
        step_metrics["time/eval"] = timer.seconds["eval"]
      metrics_writer.write(done, step_metrics)
      history.append(metrics_writer.latest)
      check_health(metrics_writer.latest, c)
      if c.log.trajectories:
        trajectory_writer.write(done, trajectory_records(trajectories, experience.advantages,
                                                         batch.loss_mask))
      progress.update(done, metrics_writer.latest)
      if c.checkpoint.every:
        checkpointer.save(done, state.tree(), _meta(c, done, schedule, cap),
                          force=done == c.steps)
    progress.close()
  checkpointer.wait()
  checkpointer.close()
  metrics_writer.close()
  if c.checkpoint.export_hf:
    params = processes.local_copy(state.params)
    if processes.index == 0:
      weights.save_hf(nnx.merge(graphdef, params), workdir / "export",
                      dtype=c.checkpoint.export_dtype)
      tokenizer.save_pretrained(workdir / "export")
  return history


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


def _meta(c: ml_collections.ConfigDict, step: int, schedule: horizon.HorizonSchedule,
          cap: int) -> dict[str, Any]:
  return {"step": step, "horizon_stage": schedule.stage(step), "horizon_cap": cap,
          "task_cursor": step * c.rollout.tasks_per_step, "seed": c.seed,
          "config": c.to_dict()}


def _step_metrics(trajectories: Sequence[rollout.Trajectory], stats: rollout.RolloutStats,
                  experience_metrics: dict[str, jax.Array],
                  update_metrics: list[dict[str, jax.Array]], cap: int, stage: int,
                  timer: PhaseTimer) -> dict[str, Any]:
  """Host-side rollout statistics plus device metrics (fetched once by the writer)."""
  rewards = np.array([t.reward for t in trajectories])
  turns = np.array([t.num_turns for t in trajectories])
  out: dict[str, Any] = {
      "reward": rewards.mean(), "success": np.mean([t.success for t in trajectories]),
      "turns": turns.mean(), "horizon_cap": cap, "horizon_stage": stage,
      "tokens_generated": stats.generated_tokens,
      "tokens_per_s": stats.generated_tokens / max(stats.generate_s, 1e-9),
      "time/generate": stats.generate_s, "time/env": stats.env_s,
      "time/env_hidden": stats.env_hidden_s,
      "rollout/env_hidden_fraction": stats.env_hidden_fraction,
  }
  for reason in (rollout.DONE, rollout.HORIZON, rollout.CONTEXT, rollout.ENV_ERROR,
                 rollout.ENV_TIMEOUT):
    out[f"termination/{reason}"] = float(np.mean([t.termination == reason
                                                  for t in trajectories]))
  out.update({f"time/{k}": v for k, v in timer.seconds.items()})
  out.update(experience_metrics)
  # Means over minibatches; the last one's optimizer counters.
  for key in update_metrics[0]:
    out[key] = jnp.mean(jnp.stack([m[key] for m in update_metrics]))
  out["nonfinite_steps"] = update_metrics[-1]["nonfinite_steps"]
  return out


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
