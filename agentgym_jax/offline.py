"""The offline train loop: supervised fine-tuning (SFT) and DPO on fixed conversations.

The same `launch/train.py` runs it when `config.mode` is "sft" or "dpo". Instead of rollouts,
every step takes one batch of conversations (agentgym_jax/offline_data.py) and makes one
optimizer step on it:

  SFT  loss = sum_{n,t} m[n,t] (-log pi(y[n,t] | y[n,<t])) / sum_{n,t} m[n,t]
       with m = 1 exactly on assistant reply tokens (and the turn end closing each reply):
       a token mean, so every reply token weighs the same whatever its conversation's length.

  DPO  log pi(y) = sum_t m[t] log pi(y_t | y_<t)   per conversation, over its reply tokens
       r(y)      = beta (log pi(y) - log pi_ref(y))
       loss      = mean over pairs of -log sigmoid(r(y_chosen) - r(y_rejected))
       pi_ref is the initial policy, frozen; its log-probs are computed per batch.

Data. `config.data.path` is a JSONL file of conversations (launch/make_demos.py writes one
verified demonstration per line) or the workdir of a run whose logged trajectories
(workdir/trajectories/*.jsonl) are used. SFT trains on the records whose reward is at least
`data.min_reward` (records without a reward, plain conversations, are kept). DPO pairs the
records of each task with `offline_data.dpo_pairs` (success beats failure, then higher reward)
and keeps the pairs whose chosen side has a reward of at least `data.min_reward`.

Metrics per step: loss, grad_norm, tokens_per_s (conversation tokens, padding excluded, per
second of reference + update time), epoch, time/*; SFT adds nll and trained_tokens, DPO adds
reward_accuracy, reward_margin, chosen/rejected_reward and chosen/rejected_logprob (the
policy's mean sequence log-probs). With eval.every > 0 the policy plays eval.split of env.name
every eval.every steps, as the RL trainer does, and the row gets eval/success etc.

Resume. The batch of step s is `batches.batch(s)`, a pure function of (data, seed, s), and a
checkpoint holds the parameters and the optimizer state, so a resumed run continues exactly as
an uninterrupted one. The reference policy is the model `config.model.name` names, loaded
anew, so it is the same on resume.

LoRA (model.lora.rank > 0) trains adapters over the frozen model as the RL loop does
(agentgym_jax/learner.py): the checkpoints hold the adapters, DPO's reference is the initial
adapters (the base exactly), and the update of step s drops the adapters' input with
`state.update_key(settings, s, 0)`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import evaluation, hooks, learner, metrics, paths
from agentgym_jax import settings as settings_lib
from agentgym_jax import state as state_lib
from agentgym_jax import offline_data, sharding
from agentgym_jax.batch import Batch
from agentgym_jax.models import Decoder
from agentgym_jax.models.tokenizer import ChatTemplate
from environments import jsonl

Array = jax.Array
MODES = ("sft", "dpo")

# --- data ----------------------------------------------------------------------------------


def load_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """The conversation records at `path` (local or gs://): a JSONL file, or a run workdir's
  trajectories."""
  path = paths.path(path)
  if path.is_dir():
    records = metrics.read_trajectories(path)
    if not records:
      raise ValueError(f"invalid config: data.path={str(path)!r} is a directory without "
                       f"logged trajectories ({path / metrics.TRAJECTORY_DIR}/step_*.jsonl); "
                       "run RL there with log.trajectories=True, or give a JSONL of "
                       "conversations")
    return records
  if not path.is_file():
    raise ValueError(f"invalid config: data.path={str(path)!r} does not exist; make "
                     f"demonstrations with e.g. python launch/make_demos.py --env=textcraft "
                     f"--split=train --out={path}")
  records = jsonl.read(path)
  if not records:
    raise ValueError(f"invalid config: data.path={str(path)!r} holds no conversations")
  return records


def sft_records(records: Sequence[dict[str, Any]], min_reward: float) -> list[dict[str, Any]]:
  """The records SFT imitates: reward >= min_reward, or no reward at all (a plain
  conversation is a demonstration by choice of whoever wrote the file)."""
  return [r for r in records if "reward" not in r or float(r["reward"]) >= min_reward]


def preference_pairs(records: Sequence[dict[str, Any]],
                     min_reward: float) -> list[offline_data.PreferencePair]:
  """`offline_data.dpo_pairs` of the records whose chosen side reached min_reward."""
  return [
      pair for pair in offline_data.dpo_pairs(records)
      if float(pair.chosen.get("reward", 0.0)) >= min_reward
  ]


def make_batches(settings: settings_lib.Settings, records: Sequence[dict[str, Any]],
                 chat: ChatTemplate) -> offline_data.SFTBatches | offline_data.DPOBatches:
  """The run's batch source: `records` (from data.path) selected and tokenized as the module
  docstring ("Data") says."""
  data = settings.data
  if settings.mode == "sft":
    kept = sft_records(records, data.min_reward)
    if len(kept) < data.batch_size:
      raise ValueError(f"invalid config: {len(kept)} of {len(records)} records in data.path="
                       f"{data.path} have a reward >= data.min_reward={data.min_reward}, "
                       f"fewer than one batch of data.batch_size={data.batch_size}")
    batches = offline_data.sft_batches(kept, chat, data.batch_size, data.max_length, settings.seed)
    logging.info(
        "SFT on %d of %d conversations (%d longer than data.max_length dropped), "
        "%d steps per epoch", batches.num_examples, len(records), batches.num_dropped,
        batches.steps_per_epoch)
    return batches
  pairs = preference_pairs(records, data.min_reward)
  if len(pairs) < data.batch_size:
    num_tasks = len({r.get("task_id") for r in records})
    raise ValueError(f"invalid config: {len(records)} trajectories of {num_tasks} tasks in "
                     f"data.path={data.path} give {len(pairs)} preference pairs, fewer than "
                     f"one batch of data.batch_size={data.batch_size}: a pair needs two "
                     f"trajectories of one task, the better with reward >= "
                     f"data.min_reward={data.min_reward}")
  batches = offline_data.dpo_batches(pairs, chat, data.batch_size, data.max_length, settings.seed)
  logging.info(
      "DPO on %d preference pairs (%d with a side longer than data.max_length "
      "dropped), %d steps per epoch", batches.num_pairs, batches.num_dropped,
      batches.steps_per_epoch)
  return batches


def stack_pairs(chosen: Batch, rejected: Batch) -> Batch:
  """One batch of 2B rows, chosen rows first: both sides run in one forward pass."""
  return jax.tree.map(lambda a, b: np.concatenate([a, b]), chosen, rejected)


def conversation_tokens(batch: Batch) -> int:
  """Real (unpadded) tokens of a host batch: every conversation ends with a trained token
  (a reply's turn end), so a row's length is one past its last trained position."""
  mask = np.asarray(batch.loss_mask) > 0
  lengths = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)
  return int(np.sum(np.where(mask.any(axis=1), lengths, 0)))


# --- the loop ------------------------------------------------------------------------------


def make_update(settings: settings_lib.Settings, params: nnx.State, mesh: Mesh):
  """(init, update): the jitted optimizer-state init and the jitted update step of the mode.

  update(networks, state, batch, dropout_key) for SFT, update(networks, state, pairs,
  ref_logprobs, dropout_key) for DPO (learner.Networks, learner.UpdateState), returns (state,
  metrics) with the state on `train_state_shardings` and its input buffers donated; it compiles
  once per padded batch length.
  """
  optimizer = settings.update.optimizer
  param_shardings, opt_shardings = sharding.train_state_shardings(
      params, jax.eval_shape(optimizer.init, params), mesh)
  if settings.mode == "sft":
    step = functools.partial(learner.sft_step, optimizer=optimizer, loss=settings.update.loss)
  else:
    step = functools.partial(learner.dpo_step, optimizer=optimizer, loss=settings.update.loss,
                             beta=settings.data.dpo_beta)
  return (jax.jit(optimizer.init, out_shardings=opt_shardings),
          jax.jit(step, donate_argnums=1,
                  out_shardings=(learner.UpdateState(param_shardings, opt_shardings), None)))


def make_evaluator(settings: settings_lib.Settings, mesh: Mesh, model: Decoder, chat: ChatTemplate,
                   stack: contextlib.ExitStack):
  """evaluate(params, step) -> eval/* metrics: success on eval.split of env.name, played as the
  RL trainer plays it (eval.* sampling, rollout.tasks_per_step x samples_per_task episodes at a
  time). The environment pool closes with `stack`."""
  rows, plan = settings.rollout.rows, settings.evaluation
  pool = stack.enter_context(settings.env.pool(rows))
  sampler = settings.rollout.sampler(model, mesh, rows)
  task_ids = plan.tasks(pool)
  key = jax.random.key(settings.seed)
  judge = settings.make_judge()

  def evaluate(params: nnx.State, step: int) -> dict[str, float]:
    player = settings.rollout.player(sampler, params, pool, chat, plan.sampling)
    summary, _ = evaluation.evaluate(player, task_ids, samples_per_task=plan.samples_per_task,
                                     horizon=plan.horizon, key=jax.random.fold_in(key, step),
                                     rows_per_batch=rows, judge=judge)
    return evaluation.as_metrics(summary)

  return evaluate


def train_offline(c: ml_collections.ConfigDict | settings_lib.Settings,
                  workdir: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """Runs (or resumes) SFT or DPO in `workdir` with config (or settings) `c`; returns the
  per-step metrics of this call."""
  settings = settings_lib.Settings.of(c)
  loss, mode = settings.update.loss, settings.mode
  if mode not in MODES:
    raise ValueError(f"invalid config: mode={mode!r} is not an offline mode {MODES}")
  workdir = paths.path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  records = load_records(settings.data.path)  # Before the model: a bad path fails at once.

  # The policy, for DPO its frozen reference, the optimizer and the jitted update.
  mesh, model, tokenizer = state_lib.load_policy(settings, training=True)
  batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
  if settings.data.batch_size % batch_devices:
    raise ValueError(f"invalid config: data.batch_size={settings.data.batch_size} must be a "
                     f"multiple of mesh data x fsdp = {batch_devices} (the rows are split over "
                     "them)")
  chat = settings.model.chat(tokenizer)
  batches = make_batches(settings, records, chat)
  policy = state_lib.Policy.of(settings, model, mesh)
  networks, params = policy.networks(), policy.params
  ref_params = policy.reference(model.dtype) if mode == "dpo" else None
  init, update = make_update(settings, params, mesh)
  # Resume from the newest complete checkpoint; step k's checkpoint follows k updates.
  checkpointer = settings.checkpoint.checkpointer(workdir, settings.steps)
  state, start_step, meta = state_lib.resume(checkpointer,
                                             state_lib.RunState(params, None, init(params)))
  if start_step and meta.get("data_size") != _data_size(batches):
    logging.warning(
        "resuming with %s examples where the checkpoint saw %s: the data order "
        "differs from the interrupted run's", _data_size(batches), meta.get("data_size"))

  to_device = functools.partial(jax.device_put, device=sharding.batch_sharding(mesh, 1))
  with contextlib.ExitStack() as stack:
    evaluate = (make_evaluator(settings, mesh, model, chat, stack)
                if settings.evaluation.every else None)
    step_hooks = hooks.StepHooks(settings, workdir, checkpointer, start_step,
                                 (("loss", "reward_accuracy") if mode == "dpo" else
                                  ("loss",)) + ("time/update", "time/eval"))
    for step in range(start_step, settings.steps):
      timer = state_lib.PhaseTimer()
      with timer("data"):
        if mode == "sft":
          host_batch = batches.batch(step)
        else:
          host_batch = stack_pairs(*batches.batch(step))
        batch = to_device(host_batch)
      inputs = (batch,)
      if mode == "dpo":
        with timer("reference"):
          inputs += (jax.block_until_ready(
              learner.reference_logprobs(networks, ref_params, batch, loss=loss)),)
      with timer("update"):
        updated, step_metrics = update(networks, learner.UpdateState(state.params, state.opt_state),
                                       *inputs, state_lib.update_key(settings, step, 0))
        jax.block_until_ready(step_metrics)
      state = state_lib.RunState(updated.trainable, None, updated.opt_state)

      done = step + 1
      compute_s = timer.seconds["update"] + timer.seconds.get("reference", 0.0)
      step_metrics["tokens_per_s"] = conversation_tokens(host_batch) / max(compute_s, 1e-9)
      step_metrics["epoch"] = done / batches.steps_per_epoch
      if evaluate is not None and settings.evaluation.after(done):
        with timer("eval"):
          step_metrics.update(evaluate(policy.sampler_params(state.params), done))
      step_metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
      step_hooks.step_end(
          done, step_metrics, state,
          dict(mode=mode, data_size=_data_size(batches), epoch=done / batches.steps_per_epoch))
    history = step_hooks.close()
  if settings.checkpoint.export_hf:
    state_lib.export_policy(settings, policy.exported(policy.export_params(state.params)),
                            tokenizer, workdir)
  return history


def _data_size(batches: offline_data.SFTBatches | offline_data.DPOBatches) -> int:
  """Conversations (SFT) or pairs (DPO) in the data: the batch order depends on it."""
  if isinstance(batches, offline_data.SFTBatches):
    return batches.num_examples
  return batches.num_pairs
