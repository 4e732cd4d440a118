"""The RL train loop: rollout -> experience -> update, one step at a time.

Everything random derives from (config.seed, step): the rollout key is fold_in(seed key, step)
(round r > 0 of a step's dynamic sampling folds in r as well), the minibatch order is seeded
with (seed, step), and the tasks come from agentgym_jax/task_sampling.py's orders, pure functions
of (seed, step, task cursor, success estimates). A resumed run therefore needs only the checkpointed step, task
cursor and success estimates (plus the parameters and optimizer state) to continue exactly as
an uninterrupted run would.

Dynamic sampling (DAPO, rollout.dynamic_sampling): a step plays rounds of tasks_per_step tasks
and keeps the groups whose rewards differ, until tasks_per_step such groups are in hand or
rollout.max_sampling_rounds rounds are played. The batch is the first tasks_per_step groups
with signal; if there are fewer, groups without signal fill it with their rows excluded from the
loss (so shapes stay static), and the metrics say how many.

Steps without learning signal (algorithm.skip_no_signal_updates): when every trained token's
advantage is exactly 0 and the loss has no other term with a gradient (no KL loss, entropy bonus
or critic), the step's gradient is 0 and it skips its optimizer updates, leaving parameters and
optimizer state as they were (`no_signal`). For a group-centred estimator the packed rewards
already show it, and the experience pass is skipped too (`no_signal_in_rewards`). A skipped step
is a step like any other (counter, task cursor, horizon, checkpoint, metrics row, trajectory
log); its row has update/skipped = 1 and none of the update's metrics (nor the experience
pass's, when that is skipped).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from absl import logging
from jax.experimental import multihost_utils

from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import state as state_lib
from agentgym_jax import evaluation, hooks, learner, paths
from agentgym_jax import judge as judge_lib
from agentgym_jax import multihost, rollout, rollout_queue, sharding, task_sampling
from agentgym_jax.batch import Batch
from agentgym_jax.models import decoder


def has_signal(group: Sequence[rollout.Trajectory], scoring: rollout.EpisodeScoring) -> bool:
  """Whether a group's rewards, as they enter the loss, are not all equal: the episodes
  `scoring` leaves out do not count, the others with its rewards, as rollout.pack treats them."""
  rewards = {scoring.reward(t) for t in group if not scoring.excluded(t)}
  return len(rewards) > 1


# The advantage estimators that score each reward against its task group's mean, a function of
# r_i - mean_g(r) (grpo_advantages, rloo_advantages): 0 on every row of a group of equal rewards.
# Not GiGPO, whose step groups compare turn returns that can differ when the episodes' rewards do
# not, nor the token-level estimators.
GROUP_CENTRED_ESTIMATORS = ("grpo", "rloo")


def gradient_only_through_advantages(loss: learner.LossConfig) -> bool:
  """Whether the policy loss is the loss's only term with a gradient (no KL loss, entropy bonus
  or value loss), so that advantages of 0 on every trained token make the gradient exactly 0."""
  return loss.kl_coef == 0 and loss.entropy_coef == 0 and not loss.uses_critic


def no_signal_in_rewards(batch: Batch, loss: learner.LossConfig) -> bool:
  """Whether a packed batch (host arrays) shows before the experience pass that every trained
  token's advantage will be exactly 0.

  It does for a group-centred estimator (GROUP_CENTRED_ESTIMATORS; no KL in the reward) when
  every group holding a trained token has equal rewards r that sum exactly in float32, in any
  order: every partial sum k r (k up to the group's size) is a float32, as for rewards 0 and 1,
  so that the group's mean is r and r - mean is 0. Equal rewards such as 0.7 sum inexactly, and
  GRPO's std + eps can turn that rounding into an advantage of a few hundredths: `no_signal`
  decides those after the experience pass.
  """
  if loss.advantage_estimator not in GROUP_CENTRED_ESTIMATORS or loss.kl_in_reward_coef:
    return False
  trained_rows = batch.loss_mask.any(axis=1)
  for group in np.unique(batch.group_ids[trained_rows]):
    rewards = batch.rewards[batch.group_ids == group]
    reward = np.float64(rewards[0])
    sums = np.arange(1, len(rewards) + 1) * reward  # Exact in float64.
    if not (np.isfinite(reward) and np.all(rewards == rewards[0])
            and np.all(sums.astype(np.float32) == sums)):
      return False
  return True


@jax.jit
def no_signal(experience: learner.Experience, loss_mask: jax.Array) -> jax.Array:
  """Whether every trained token's advantage is exactly 0 (NaN is not): a bool scalar over the
  loss's tokens, those of loss_mask f32[N, T] (aligned with the tokens) in the trajectories the
  rollout correction keeps."""
  trained = loss_mask[:, 1:] * experience.kept[:, None] > 0
  return jnp.all(jnp.where(trained, experience.advantages == 0, True))


@dataclasses.dataclass
class StepRollout:
  """A step's episodes.

  Attributes:
    batch: the trajectories it trains on, tasks_per_step groups of samples_per_task, their
      groups numbered 0, 1, ... in order.
    trained: per row of `batch`, whether it enters the loss (False for the rows of a group
      without signal that only fills the batch).
    played: every trajectory played, in every round.
    stats: the rollout statistics of every round, summed.
    rounds: the rounds played.
    signal_groups: the groups played whose rewards differ (all of them without dynamic
      sampling, which does not look).
  """

  batch: list[rollout.Trajectory]
  trained: list[bool]
  played: list[rollout.Trajectory]
  stats: rollout.RolloutStats
  rounds: int
  signal_groups: int

  def state(self) -> dict[str, Any]:
    """JSON-safe, for a checkpoint's buffered rollouts (rollout_queue.py); `from_state`
    inverts it."""
    return {
        "batch": [t.state() for t in self.batch], "trained": self.trained,
        "played": [t.state() for t in self.played], "stats": dataclasses.asdict(self.stats),
        "rounds": self.rounds, "signal_groups": self.signal_groups
    }

  @classmethod
  def from_state(cls, state: dict[str, Any]) -> StepRollout:
    return cls(batch=[rollout.Trajectory.from_state(t) for t in state["batch"]],
               trained=state["trained"],
               played=[rollout.Trajectory.from_state(t) for t in state["played"]],
               stats=rollout.RolloutStats(**state["stats"]), rounds=state["rounds"],
               signal_groups=state["signal_groups"])

  def metrics(self, tasks_per_step: int) -> dict[str, float]:
    """Dynamic sampling's metrics: rounds played, the fraction of played groups kept (with
    signal), and the groups without signal filling the batch (0 unless rounds ran out)."""
    played_groups = self.rounds * tasks_per_step
    return {
        "dynamic_sampling/rounds": self.rounds,
        "dynamic_sampling/kept_fraction": self.signal_groups / played_groups,
        "dynamic_sampling/filled_groups": max(tasks_per_step - self.signal_groups, 0)
    }


def play_step(play: Callable[[list[int], int],
                             tuple[list[rollout.Trajectory],
                                   rollout.RolloutStats]], draw: Callable[[int], list[int]], *,
              tasks_per_step: int, samples_per_task: int, dynamic_sampling: bool, max_rounds: int,
              scoring: rollout.EpisodeScoring) -> StepRollout:
  """Plays a step's rounds: round r plays the tasks_per_step tasks `draw(r)` (a task order's
  `draws`), drawn once the rounds before it were played.

  `play(task_ids, round)` plays samples_per_task episodes of each task, grouped task by task.
  Without dynamic sampling that is one round, all of it trained on.
  """
  played, stats, signal, other = [], [], [], []
  for round_index in range(max_rounds if dynamic_sampling else 1):
    trajectories, round_stats = play(draw(round_index), round_index)
    played.extend(trajectories)
    stats.append(round_stats)
    for start in range(0, len(trajectories), samples_per_task):
      group = trajectories[start:start + samples_per_task]
      (signal if not dynamic_sampling or has_signal(group, scoring) else other).append(group)
    if len(signal) >= tasks_per_step:
      break
  groups = (signal + other)[:tasks_per_step]
  batch = [
      dataclasses.replace(t, group=number) for number, group in enumerate(groups) for t in group
  ]
  trained = [number < len(signal) for number, group in enumerate(groups) for _ in group]
  return StepRollout(batch, trained, played, rollout.RolloutStats.total(stats), len(stats),
                     len(signal))


def trajectory_records(trajectories: Sequence[rollout.Trajectory], advantages: jax.Array | None,
                       loss_mask: jax.Array) -> list[dict[str, Any]]:
  """The step's trajectory log records, each with its sample index within its group and its
  advantage: the mean over its trained tokens (GRPO's and RLOO's one value a row; a summary of
  GAE's per-token ones), None for a row without trained tokens (an excluded failed episode).

  advantages f32[N, T-1] are aligned with the targets, loss_mask f32[N, T] with the tokens;
  advantages None are 0 (a step whose rewards showed it, and that skipped its experience pass).
  """
  mask = loss_mask[:, 1:]
  trained = jnp.sum(mask, axis=-1)
  row_advantage = (jnp.zeros_like(trained) if advantages is None else
                   jnp.sum(advantages * mask, axis=-1) / jnp.maximum(trained, 1.0))
  row_advantage, trained = multihost_utils.process_allgather((row_advantage, trained), tiled=True)
  samples = collections.Counter()
  records = []
  for t, advantage, count in zip(trajectories, row_advantage.tolist(), trained.tolist()):
    records.append(
        {**t.to_json(), "sample": samples[t.group], "advantage": advantage if count else None})
    samples[t.group] += 1
  return records


# The judge's replies, kept in a run's workdir (judge.ReplyCache).
JUDGE_CACHE = "judge_cache.jsonl"

PROGRESS_KEYS = ("reward", "success", "horizon_cap", "time/rollout", "time/experience",
                 "time/update", "time/eval")


@dataclasses.dataclass
class Actor:
  """What plays the RL loop's episodes: this process's sampler of the policy, the chat layout,
  and its share of each step's rows, played in waves of `wave` rows.

  Attributes:
    settings: the run's settings (sampling, context limit, groups of the step).
    sampler: this process's sampler, `wave` rows wide.
    chat: the policy's chat layout.
    policy: the trained policy (the sampler runs its merged parameters with LoRA).
    dtype: the sampler's matmul dtype.
    processes: the run's processes (each plays its rows on its own devices).
    rows: this process's rows of the step.
    wave: rows played at once.
    own_mesh: whether the sampler has a mesh of its own (mesh.rollout_devices).
    judge: what scores the episodes after they are played (reward.judge), or None.
  """

  settings: settings_lib.Settings
  sampler: Any
  chat: Any
  policy: state_lib.Policy
  dtype: Any
  processes: multihost.Processes
  rows: range
  wave: int
  own_mesh: bool = False
  judge: judge_lib.Judge | None = None

  @classmethod
  def create(cls, settings: settings_lib.Settings, model: Any, chat: Any, policy: state_lib.Policy,
             processes: multihost.Processes, judge: judge_lib.Judge | None = None) -> Actor:
    rows = processes.rows(settings.rollout.rows)
    wave = settings.rollout.wave(len(rows))
    own_mesh = settings.model.make_rollout_mesh()
    sampler = settings.rollout.sampler(model, own_mesh or processes.local_mesh, wave)
    return cls(settings, sampler, chat, policy, model.dtype, processes, rows, wave, own_mesh
               is not None, judge)

  def sampler_params(self, params: nnx.State) -> nnx.State:
    """The policy as this process's sampler runs it (with LoRA, merged): once per rollout or
    evaluation. On a mesh of its own the sampler reads a copy moved there device to device (the
    split mesh's weight copy), its matmul weights in the matmul dtype (half the bytes in bf16),
    laid out by the logical rules on the sampler's mesh."""
    params = self.policy.sampler_params(params)
    if not self.own_mesh:
      return self.processes.sampler_copy(params, self.dtype)
    narrow = decoder.matmul_copy(params, self.dtype)
    return jax.device_put(narrow, sharding.state_shardings(narrow, self.sampler.mesh))

  def task_orders(self, pool: Any, estimates: task_sampling.SuccessEstimates | None) -> list[Any]:
    """Each curriculum stage's task order (learnability draws when `estimates` are kept); a
    mixture's one order, by its environments' weights."""
    settings = self.settings
    order = task_sampling.TaskOrder if estimates is None else functools.partial(
        task_sampling.LearnabilityOrder, estimates=estimates,
        floor=settings.rollout.task_sampling_floor)
    if settings.env.mixture:
      weights = {component.label: component.weight for component in settings.env.mixture}
      return [task_sampling.mixture_order(pool, weights, settings.seed, order)]
    return task_sampling.stage_task_orders(pool, settings.rollout.curriculum, settings.seed, order)

  def play_step(self, pool: Any, params: nnx.State, draw: Callable[[int], list[int]], step: int,
                cap: int, estimates: task_sampling.SuccessEstimates | None, version: int = 0,
                switches: rollout.PolicySwitches | None = None) -> StepRollout:
    """Plays step `step`'s episodes (`play_step`) up to `cap` turns, with the policy of `params`;
    the rows of every process are gathered and judged (every process judges them all, so its
    judge must be deterministic: greedy, as judge.py asks), and the success `estimates` observe
    each round before the next is drawn. `params` are the policy after `version` updates; with
    partial rollouts the rollout moves on to newer ones at the decode calls `switches` says."""
    settings = self.settings
    step_key = jax.random.fold_in(jax.random.key(settings.seed), step)
    # The sampler's copy of the policy, alive for the rollout.
    player = settings.rollout.player(self.sampler, self.sampler_params(params), pool, self.chat)
    if switches is not None:  # Its first policy: the sampler's copy made here.
      switches = dataclasses.replace(switches, current=(version, player.params))
    player = dataclasses.replace(player, version=version, switches=switches)

    def play(task_ids: list[int], round_index: int):
      group_of = [(task_id, group) for group, task_id in enumerate(task_ids)
                  for _ in range(settings.rollout.samples_per_task)]
      key = jax.random.fold_in(step_key, round_index) if round_index else step_key
      played, stats = rollout.collect_waves(player, group_of[self.rows.start:self.rows.stop],
                                            wave_rows=self.wave, horizon=cap, key=key,
                                            first_row=self.rows.start)
      played, stats = self.processes.gather_rollout(played, stats)
      if self.judge is not None:
        stats = dataclasses.replace(stats, judge_s=self.judge(played))
      if estimates is not None:  # Before the next round's draw.
        estimates.observe(played)
      return played, stats

    return play_step(play, draw, tasks_per_step=settings.rollout.tasks_per_step,
                     samples_per_task=settings.rollout.samples_per_task,
                     dynamic_sampling=settings.rollout.dynamic_sampling,
                     max_rounds=settings.rollout.max_sampling_rounds,
                     scoring=settings.update.scoring)

  def evaluate(self, pool: Any, params: nnx.State, step: int) -> dict[str, float]:
    """The eval/* metrics of the policy of `params` after step `step`: eval.split's tasks, each
    process playing its share, with a key distinct from every step's."""
    plan = self.settings.evaluation
    eval_key = jax.random.fold_in(jax.random.key(self.settings.seed), 1 << 30)
    task_ids = plan.tasks(pool)
    player = self.settings.rollout.player(self.sampler, self.sampler_params(params), pool,
                                          self.chat, plan.sampling)
    key = jax.random.fold_in(eval_key, step)
    _, played = evaluation.evaluate(player, self.processes.share(task_ids),
                                    samples_per_task=plan.samples_per_task, horizon=plan.horizon,
                                    key=key, rows_per_batch=self.wave, judge=self.judge)
    summary = evaluation.summarize(self.processes.gather(played),
                                   evaluation.task_categories(pool, task_ids))
    return evaluation.as_metrics(summary)


@dataclasses.dataclass
class Learner:
  """What the RL update trains and how: the policy (its graph and, with LoRA, its frozen base),
  the KL's reference parameters, the value head's graph, the optimizer state's shardings and
  the jitted update step.

  Attributes:
    policy: the trained policy (state.Policy).
    reference: the reference parameters of a KL loss, or None.
    networks: the policy's graph, the value head's (PPO's critic) or None, and LoRA's frozen
      base or None.
    opt_shardings: the optimizer state's shardings on the mesh.
    update_step: learner.update_step, jitted on the state's shardings.
    settings: the run's settings (the loss, the optimizer, the minibatches).
  """

  policy: state_lib.Policy
  reference: nnx.State | None
  networks: learner.Networks
  opt_shardings: Any
  update_step: Callable[..., Any]
  settings: settings_lib.Settings

  @classmethod
  def create(cls, settings: settings_lib.Settings, model: Any,
             mesh: Any) -> tuple[Learner, state_lib.RunState]:
    """The learner of `model` on `mesh`, and the run's initial state."""
    loss = settings.update.loss
    # What is trained: the model's parameters, or with LoRA adapters over the frozen model.
    policy = state_lib.Policy.of(settings, model, mesh)
    reference = policy.reference(model.dtype) if loss.uses_reference else None
    value_graphdef = value_params = None
    if loss.uses_critic:
      value_graphdef, value_params = nnx.split(learner.ValueHead(model.config.hidden_size))
    # Committed to the mesh, as the update's outputs will be: otherwise the first step's inputs
    # differ from the next steps' and every jitted function compiles twice.
    optimizer = settings.update.optimizer
    trainable_shardings, opt_shardings = sharding.train_state_shardings(
        (policy.params, value_params), jax.eval_shape(optimizer.init,
                                                      (policy.params, value_params)), mesh)
    value_params = jax.device_put(value_params, trainable_shardings[1])
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)((policy.params, value_params))
    update_step = learner.jit_update_step(learner.UpdateState(trainable_shardings, opt_shardings))
    return (cls(policy, reference, policy.networks(value_graphdef), opt_shardings, update_step,
                settings), state_lib.RunState(policy.params, value_params, opt_state))

  def place(self, opt_state: Any, on_host: bool | None = None) -> Any:
    """The optimizer state where it waits between updates (on_host None) or where the update
    reads it (on_host False)."""
    return state_lib.place_optimizer_state(
        opt_state, self.opt_shardings,
        on_host=self.settings.update.offload_optimizer if on_host is None else on_host)

  def experience(self, state: state_lib.RunState,
                 batch: Batch) -> tuple[learner.Experience, dict[str, Any]]:
    """The experience pass over `batch`: old and reference log-probs, values, advantages."""
    settings = self.settings
    return learner.compute_experience(self.networks, (state.params, state.value_params),
                                      self.reference, batch, loss=settings.update.loss,
                                      num_groups=2 * settings.rollout.rows,
                                      num_turns=settings.schedule.max_turns)

  def update(self, state: state_lib.RunState, batch: Batch, row_groups: Any,
             experience: learner.Experience, step: int,
             shards: int) -> tuple[state_lib.RunState, list[dict[str, Any]]]:
    """ppo_epochs passes of num_minibatches optimizer steps; the first runs on the
    experience's parameters, so its ratio is exactly 1. Returns the state and the minibatches'
    metrics."""
    settings = self.settings
    update_state = learner.UpdateState((state.params, state.value_params),
                                       self.place(state.opt_state, on_host=False))
    rng = np.random.default_rng([settings.seed, step])
    update_metrics = []
    for update, rows in enumerate(
        learner.minibatch_indices(settings.rollout.rows, settings.update.num_minibatches,
                                  settings.update.ppo_epochs, rng, row_groups)):
      minibatch = learner.take_batch(batch, rows, row_groups, shards)
      update_state, m = self.update_step(self.networks, update_state, minibatch,
                                         learner.take_rows(experience, rows),
                                         optimizer=settings.update.optimizer,
                                         loss=settings.update.loss,
                                         key=state_lib.update_key(settings, step, update),
                                         on_policy=jnp.asarray(update == 0))
      update_metrics.append(m)
    (params, value_params), opt_state = update_state.trainable, update_state.opt_state
    state = state_lib.RunState(*jax.block_until_ready((params, value_params,
                                                       self.place(opt_state))))
    return state, update_metrics


def pack_step(step_rollout: StepRollout, settings: settings_lib.Settings,
              shards: int) -> tuple[Batch, Any]:
  """The step's batch on the host, its untrained rows (dynamic sampling's fillers) left out of
  the loss, and with shared prompts the packed rows of each trajectory (to draw minibatches of
  whole tasks), else None."""
  batch = rollout.pack(step_rollout.batch, turns=settings.schedule.max_turns,
                       scoring=settings.update.scoring,
                       shared_prompts=settings.update.shared_prompts, packed_rows_multiple=shards,
                       contexts=settings.rollout.context.rewrites)
  row_groups = None if batch.shared is None else batch.shared.rows
  trained = np.asarray(step_rollout.trained, np.float32)[:, None]
  return batch.replace(loss_mask=batch.loss_mask * trained), row_groups


def train(c: ml_collections.ConfigDict | settings_lib.Settings,
          workdir: str | pathlib.Path) -> list[dict[str, Any]]:
  """Runs (or resumes) RL in `workdir` with config (or settings) `c`; returns the per-step
  metrics of this call."""
  settings = settings_lib.Settings.of(c)
  if settings.mode != "rl":
    raise config_lib.ConfigError(
        f"invalid config: mode={settings.mode!r}: trainer.train runs RL (mode='rl'); SFT and "
        "DPO run with offline.train_offline, or launch/train.py for either")
  workdir = paths.path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  mesh, model, tokenizer = state_lib.load_policy(settings, training=True)
  chat = settings.model.chat(tokenizer)
  learner_, initial = Learner.create(settings, model, mesh)
  policy, schedule, shards = learner_.policy, settings.schedule, sharding.batch_shards(mesh)
  skip_no_signal = settings.update.skip_no_signal_updates and gradient_only_through_advantages(
      settings.update.loss)

  # Resume from the newest complete checkpoint, if any. Steps count completed RL steps: the
  # checkpoint, metrics row and trajectory file of step k are written after k updates.
  checkpointer = settings.checkpoint.checkpointer(workdir, settings.steps)
  state, start_step, meta = state_lib.resume(checkpointer, initial)
  state.opt_state = learner_.place(state.opt_state)
  # The position in the task stream: tasks_per_step a step, more with dynamic sampling.
  cursor = int(meta.get("task_cursor", start_step * settings.rollout.tasks_per_step))
  # With learnability draws, the success estimates of the episodes played so far.
  estimates = None
  if settings.rollout.task_sampling == "learnability":
    estimates = task_sampling.SuccessEstimates.from_meta(settings.rollout.task_sampling_rate,
                                                         meta.get("task_success", ()))
  # Each process plays its rows of the step on its own devices (all of them on one process).
  processes = multihost.Processes.of(mesh)
  settings.check_layout(mesh, processes.count)
  judge = settings.make_judge(workdir / JUDGE_CACHE)
  actor = Actor.create(settings, model, chat, policy, processes, judge)
  hooks_ = hooks.StepHooks(settings, workdir, checkpointer, start_step, PROGRESS_KEYS,
                           trajectory_log=True, shown=processes.index == 0)
  stale, partial = settings.rollout.max_staleness, settings.rollout.partial_rollouts
  with settings.env.pool(actor.wave) as pool:
    task_orders = actor.task_orders(pool, estimates)

    def play(step: int, params: nnx.State, version: int) -> StepRollout:
      """1. Rollout: B tasks x n samples, up to step `step`'s horizon cap (more rounds of B
      tasks with dynamic sampling), played by the policy of `params` after `version` updates;
      on the rollout side (rollout_queue.py), which owns the task cursor and the estimates."""
      nonlocal cursor
      tasks = task_orders[min(schedule.stage(step), len(task_orders) - 1)]
      # Partial rollouts move up to the step's own policy, or to that of the first update after
      # which the learner waits for the rollouts queued (to checkpoint them, or for an
      # evaluation queued behind them), which must then finish without the policies to come.
      last = min([step] + [done for done in range(version, step) if waits_for_rollouts(done)])
      switches = None
      if partial and last > version:
        switches = rollout.PolicySwitches(version, last, partial,
                                          lambda v: actor.sampler_params(queue.policy(v)))
      step_rollout = actor.play_step(pool, params,
                                     tasks.draws(step, cursor, settings.rollout.tasks_per_step),
                                     step, schedule.cap(step), estimates, version, switches)
      cursor += step_rollout.rounds * settings.rollout.tasks_per_step
      for trajectory in step_rollout.played + step_rollout.batch:
        trajectory.policy_version = version
      return step_rollout

    def waits_for_rollouts(done: int) -> bool:
      """Whether, after update `done`, the learner waits for the rollouts queued: to checkpoint
      them, or for an evaluation queued behind them."""
      return done > 0 and (hooks_.saves(done) or settings.evaluation.after(done))

    with rollout_queue.RolloutQueue(play, stale, snapshot=_copy) as queue:
      if partial:
        queue.publish(start_step, state.params)
      # The steps played ahead: the checkpoint's buffered rollouts on resume, else the policy's.
      buffered = meta.get("rollout_buffer", {})
      for ahead in range(start_step, min(start_step + stale + 1, settings.steps)):
        if str(ahead) in buffered:
          queue.put(ahead, StepRollout.from_state(buffered[str(ahead)]))
        else:
          if start_step and stale:
            logging.warning(
                "step %d: the checkpoint holds no rollout played ahead for it (the run ended "
                "there, or ran with another rollout.max_staleness); the resumed policy plays it",
                ahead + 1)
          queue.submit(ahead, state.params, start_step)
      for step in range(start_step, settings.steps):
        timer = state_lib.PhaseTimer()
        cap = schedule.cap(step)
        with timer("rollout"):
          step_rollout = queue.take(step)
        # 2. Experience: old and reference log-probs, values, advantages.
        with timer("experience"):
          batch, row_groups = pack_step(step_rollout, settings, shards)
          skip = skip_no_signal and no_signal_in_rewards(batch, settings.update.loss)
          batch = jax.device_put(batch, sharding.batch_sharding(mesh, 1))
          experience, experience_metrics = None, {}
          if not skip:
            experience, experience_metrics = learner_.experience(state, batch)
            jax.block_until_ready(experience)  # So that the phase timers measure device work.
            skip = skip_no_signal and bool(no_signal(experience, batch.loss_mask))
        # 3. Update (none without signal).
        update_metrics = []
        if not skip:
          with timer("update"):
            state, update_metrics = learner_.update(state, batch, row_groups, experience, step,
                                                    shards)

        done = step + 1
        if partial:
          queue.publish(done, state.params)
        if done + stale < settings.steps:
          queue.submit(done + stale, state.params, done)
        step_metrics = _step_metrics(step_rollout.played, step_rollout.stats, experience_metrics,
                                     update_metrics, state.opt_state.notfinite_count, cap,
                                     schedule.stage(step), timer)
        step_metrics.update(settings.update.scoring.metrics(step_rollout.played))
        if settings.env.mixture:
          step_metrics.update(rollout.environment_metrics(step_rollout.played))
        if judge:
          step_metrics.update(judge_lib.metrics(step_rollout.played, step_rollout.stats.judge_s))
        if stale:
          step_metrics["rollout/staleness"] = step - step_rollout.played[0].policy_version
        if partial:
          versions = [v for t in step_rollout.played for v in t.turn_versions]
          step_metrics["rollout/turn_staleness"] = step - float(np.mean(versions or [step]))
        if settings.rollout.dynamic_sampling:
          step_metrics.update(step_rollout.metrics(settings.rollout.tasks_per_step))
          if step_metrics["dynamic_sampling/filled_groups"]:
            logging.warning(
                "step %d: %d of %d groups have signal after rollout.max_sampling_rounds=%d "
                "rounds; training on those only", done, step_rollout.signal_groups,
                settings.rollout.tasks_per_step, step_rollout.rounds)
        if settings.evaluation.after(done):
          with timer("eval"):
            step_metrics.update(queue.run(actor.evaluate, pool, state.params, done))
          step_metrics["time/eval"] = timer.seconds["eval"]
        run_meta = {}
        if hooks_.saves(done):
          # What a resumed run needs: the rollouts played ahead (waited for), and the task
          # cursor and estimates after them.
          ahead = {str(s): played.state() for s, played in queue.played().items()}
          run_meta = dict(horizon_stage=schedule.stage(done), horizon_cap=cap, task_cursor=cursor,
                          **({} if estimates is None else {"task_success": estimates.to_meta()}),
                          **({"rollout_buffer": ahead} if ahead else {}))
        hooks_.step_end(
            done, step_metrics, state, run_meta, trajectories=lambda: trajectory_records(
                step_rollout.batch, None
                if experience is None else experience.advantages, batch.loss_mask))
  history = hooks_.close()
  if settings.checkpoint.export_hf:
    exported = processes.local_copy(policy.export_params(state.params))
    if processes.index == 0:
      state_lib.export_policy(settings, policy.exported(exported), tokenizer, workdir)
  return history


def _copy(params: nnx.State) -> nnx.State:
  """A copy of `params` that the next update, which donates their buffers, leaves alone."""
  return jax.tree.map(jnp.copy, params)


def _step_metrics(trajectories: Sequence[rollout.Trajectory], stats: rollout.RolloutStats,
                  experience_metrics: dict[str, jax.Array],
                  update_metrics: list[dict[str, jax.Array]], nonfinite_steps: jax.Array, cap: int,
                  stage: int, timer: state_lib.PhaseTimer) -> dict[str, Any]:
  """Host-side rollout statistics plus device metrics (fetched once by the writer): those of
  the experience pass and the update when they ran (update/skipped says whether it did), and
  the optimizer's count of consecutive non-finite updates, which a skipped step leaves as it
  was."""
  rewards = np.array([t.reward for t in trajectories])
  turns = np.array([t.num_turns for t in trajectories])
  out: dict[str, Any] = {
      "reward": rewards.mean(),
      "success": np.mean([t.success for t in trajectories]),
      "turns": turns.mean(),
      "horizon_cap": cap,
      "horizon_stage": stage,
      "tokens_generated": stats.generated_tokens,
      "tokens_per_s": stats.generated_tokens / max(stats.generate_s, 1e-9),
      "time/generate": stats.generate_s,
      "time/env": stats.env_s,
      "time/env_hidden": stats.env_hidden_s,
      "rollout/env_hidden_fraction": stats.env_hidden_fraction,
      "rollout/idle_row_fraction": stats.idle_row_fraction,
      **{f"rollout/idle_rows/{part}": share for part, share in stats.idle_parts().items()},
  }
  for reason in (rollout.DONE, rollout.HORIZON, rollout.CONTEXT, rollout.ENV_ERROR,
                 rollout.ENV_TIMEOUT):
    out[f"termination/{reason}"] = float(np.mean([t.termination == reason for t in trajectories]))
  out.update(rollout.context_metrics(trajectories))
  out.update({f"time/{k}": v for k, v in timer.seconds.items()})
  out.update(experience_metrics)
  out["update/skipped"] = 0.0 if update_metrics else 1.0
  # Means over minibatches.
  for key in update_metrics[0] if update_metrics else ():
    out[key] = jnp.mean(jnp.stack([m[key] for m in update_metrics]))
  out["nonfinite_steps"] = nonfinite_steps
  return out
