"""What every training loop shares: the policy and its sampler, the optimizer, the state and its
shardings, checkpoint resume, health checks, phase timing and the export.

The RL loop (trainer.py) and the offline loop (offline.py) sit side by side on top of this
module; neither imports the other.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import pathlib
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import checkpoint, config as config_lib, horizon, learner, metrics, rl, rollout
from agentgym_jax import hardware, memory, multihost, paths, sharding
from agentgym_jax.batch import packed_length
from agentgym_jax.models import Decoder, attention, decoder, load_model, lora as lora_lib, weights
from agentgym_jax.models.tokenizer import ChatTemplate, Tokenizer
from agentgym_jax.sampling import Sampler
from agentgym_jax.tools import viewer
from environments.pool import EnvPool

# --- the settings ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """How a run evaluates: every `every` steps (0: never), the first `max_tasks` tasks (0: all)
  of `split`, `samples_per_task` episodes each, turns sampled by `sampling` up to `horizon`;
  the recipe's stage evaluations (`stages`) play `rows` episodes at once (0: a step's rows) and
  are kept by fingerprint in `cache_dir` ("": not kept)."""

  every: int
  split: str
  max_tasks: int
  samples_per_task: int
  sampling: rollout.TurnSampling
  horizon: int
  stages: bool
  rows: int
  cache_dir: str

  def tasks(self, pool: EnvPool) -> list[int]:
    task_ids = list(pool.task_ids(self.split))
    return task_ids[:self.max_tasks] if self.max_tasks else task_ids


@dataclasses.dataclass(frozen=True)
class Data:
  """An offline run's conversations: the file or run at `path`, the records with a reward of at
  least `min_reward`, `batch_size` conversations (pairs, for DPO) a step, each at most
  `max_length` tokens."""

  path: str
  min_reward: float
  batch_size: int
  max_length: int


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """How an RL step plays its episodes (config group rollout).

  Attributes:
    sampling: how turns are sampled.
    tasks_per_step, samples_per_task: a step's tasks and the size of each task's group.
    dynamic_sampling, max_sampling_rounds: whether a step keeps only groups whose rewards
      differ, playing up to max_sampling_rounds rounds of tasks_per_step tasks (DAPO).
    curriculum: per horizon stage, the categories of the tasks it trains on (() for all).
    task_sampling, task_sampling_floor, task_sampling_rate: how a step draws its tasks from its
      stage's (permutation | learnability; trainer.py).
    max_context, pipeline_groups: tokens per trajectory (KV-cache slots), and the row groups
      whose environment steps overlap the other groups' decoding.
    wave_rows: the rows a process plays at once (0: all of its rows); see `wave`.
  """

  sampling: rollout.TurnSampling
  tasks_per_step: int
  samples_per_task: int
  dynamic_sampling: bool
  max_sampling_rounds: int
  curriculum: tuple[tuple[str, ...], ...]
  task_sampling: str
  task_sampling_floor: float
  task_sampling_rate: float
  max_context: int
  pipeline_groups: int
  wave_rows: int

  @property
  def rows(self) -> int:
    """Trajectories per step: tasks_per_step x samples_per_task."""
    return self.tasks_per_step * self.samples_per_task

  def wave(self, rows: int) -> int:
    """How many of a process's `rows` it plays at once: rollout.wave_rows, at most `rows`."""
    return min(self.wave_rows or rows, rows)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """The policy (config groups model and mesh, and rollout.cache_dtype): the checkpoint `name`,
  its numerics as configured (`dtype` auto is resolved by `matmul_dtype`), the learner's
  attention and remat, model.thinking (on | off), the (data, fsdp, tensor) mesh, the KV
  cache's dtype ("": the matmul dtype) and LoRA (None: every weight is trained)."""

  name: str
  dtype: str
  param_dtype: str
  attention: str
  remat: str
  thinking: str
  mesh: tuple[int, int, int]
  cache_dtype: str
  lora: lora_lib.LoraSettings | None

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> ModelSettings:
    m = c.model
    return cls(name=m.name, dtype=m.dtype, param_dtype=m.param_dtype, attention=m.attention,
               remat=m.remat, thinking=m.thinking, mesh=(c.mesh.data, c.mesh.fsdp, c.mesh.tensor),
               cache_dtype=c.rollout.cache_dtype, lora=_lora_settings(c))

  def matmul_dtype(self) -> str:
    """model.dtype with auto resolved for this machine (hardware.matmul_dtype)."""
    return hardware.matmul_dtype(self.dtype)

  def make_mesh(self) -> Mesh:
    return sharding.make_mesh(*self.mesh)


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """The environment (config group env): its registered `name`, its adapters' keyword arguments
  (`options`: env.options, and the action format when it is not react), how its episodes run
  (backend, step_timeout) and how its faults enter the loss (failed_episodes)."""

  name: str
  options: dict[str, Any]
  action_format: str
  backend: str
  step_timeout: float
  failed_episodes: str

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> EnvSettings:
    e = c.env
    return cls(name=e.name, options=config_lib.env_options(c), action_format=e.action_format,
               backend=e.backend, step_timeout=e.step_timeout, failed_episodes=e.failed_episodes)

  def pool(self, rows: int) -> EnvPool:
    """A pool of `rows` episodes of the environment."""
    return EnvPool(self.name, rows, options=self.options, backend=self.backend,
                   step_timeout_s=self.step_timeout)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
  """Checkpoints and the export (config group checkpoint): every `every` steps (0: only the
  last), the newest `keep` kept; the run ends by exporting its policy if `export_hf`, in
  `export_format` (merged | peft) and `export_dtype`."""

  every: int
  keep: int
  export_hf: bool
  export_format: str
  export_dtype: str


@dataclasses.dataclass(frozen=True)
class LogSettings:
  """What a run logs beside metrics.jsonl (config group log): TensorBoard, Weights & Biases
  (project, run name: "" for the workdir's), the console progress bar and RL trajectories."""

  tensorboard: bool
  wandb: bool
  wandb_project: str
  wandb_run_name: str
  progress_bar: bool
  trajectories: bool


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """An RL run's SFT warm start (config group warm_start): `steps` SFT steps (0: none) on the
  demonstrations in `demonstrations`, or on the environment expert's of up to `max_tasks`
  train tasks (0: all) when that is ""."""

  steps: int
  demonstrations: str
  max_tasks: int


def _group(cls: type[Any], group: ml_collections.ConfigDict) -> Any:
  """A settings dataclass whose fields are keys of the config `group`, read from it."""
  return cls(**{field.name: group[field.name] for field in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a run derives from its config, built and validated once (`from_config`) and handed
  to the loops, which read nothing else: their plain values, the objects they run with
  (horizon schedule, turn samplings, optimizer, loss settings) and the factories of what they
  open (policy, sampler, environment pool, checkpointer, writers).

  Attributes:
    record: the validated config as plain data, recorded in checkpoints' meta and wandb.
    mode, seed, steps: the run's kind (rl | sft | dpo), its seed and its number of steps.
    model, env, checkpoint, log, warm_start: the config groups of the same names
      (`ModelSettings`, `EnvSettings`, `CheckpointSettings`, `LogSettings`, `WarmStart`).
    schedule: the ScalingInter-RL horizon schedule (the turn cap of every step).
    evaluation: what, how and how often the run evaluates.
    optimizer: AdamW over the run's optimizer updates.
    loss: the static loss settings compiled into the update (offline modes read only the
      log-prob chunk and score the model's own distribution, temperature 1).
    rollout: how an RL step plays its episodes (`RolloutSettings`).
    num_minibatches, ppo_epochs: an RL step's updates.
    shared_prompts: whether the learner packs each task's samples as one row (batch.py).
    skip_no_signal_updates: whether a step without learning signal skips its update
      (algorithm.skip_no_signal_updates; trainer.py).
    data, dpo_beta: an offline run's conversations, and DPO's beta.
    max_consecutive_nonfinite, max_logprob_gap: when `check_health` stops the run.
  """

  record: dict[str, Any]
  mode: str
  seed: int
  steps: int
  schedule: horizon.HorizonSchedule
  rollout: RolloutSettings
  evaluation: Evaluation
  optimizer: optax.GradientTransformation
  offload_optimizer: bool
  loss: learner.LossConfig
  num_minibatches: int
  ppo_epochs: int
  shared_prompts: bool
  skip_no_signal_updates: bool
  data: Data
  dpo_beta: float
  model: ModelSettings
  env: EnvSettings
  checkpoint: CheckpointSettings
  log: LogSettings
  warm_start: WarmStart
  max_consecutive_nonfinite: int
  max_logprob_gap: float

  @classmethod
  def of(cls, c: ml_collections.ConfigDict | Settings) -> Settings:
    """`c` itself if it is settings already, else its settings (`from_config`): a loop called
    with a config validates it here, one called with settings (the recipe's stages, the
    command) takes them as they are."""
    return c if isinstance(c, Settings) else cls.from_config(c)

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> Settings:
    """The settings of config `c`, which is validated (config.validate) on the way."""
    c = config_lib.validate(c)
    schedule = horizon.make_horizon_schedule(config_lib.horizon_options(c))
    turn = functools.partial(rollout.TurnSampling, max_new_tokens=c.rollout.max_new_tokens,
                             top_p=c.rollout.top_p, top_k=c.rollout.top_k)
    r, e = c.rollout, c.eval
    evaluation = Evaluation(every=e.every, split=e.split, max_tasks=e.max_tasks,
                            samples_per_task=e.samples_per_task,
                            sampling=turn(temperature=e.temperature), horizon=e.horizon
                            or schedule.max_turns, stages=e.stages, rows=e.rows,
                            cache_dir=e.cache_dir)
    rollout_settings = RolloutSettings(
        sampling=turn(temperature=r.temperature), tasks_per_step=r.tasks_per_step,
        samples_per_task=r.samples_per_task, dynamic_sampling=r.dynamic_sampling,
        max_sampling_rounds=r.max_sampling_rounds,
        curriculum=tuple(tuple(stage) for stage in r.curriculum), task_sampling=r.task_sampling,
        task_sampling_floor=r.task_sampling_floor, task_sampling_rate=r.task_sampling_rate,
        max_context=r.max_context, pipeline_groups=r.pipeline_groups, wave_rows=r.wave_rows)
    data = Data(path=c.data.path, min_reward=c.data.min_reward, batch_size=c.data.batch_size,
                max_length=c.data.max_length)
    return cls(record=c.to_dict(), mode=c.mode, seed=c.seed, steps=c.steps, schedule=schedule,
               rollout=rollout_settings, evaluation=evaluation, optimizer=configured_optimizer(c),
               offload_optimizer=c.optim.offload_state, loss=_loss_config(c),
               num_minibatches=c.algorithm.num_minibatches, ppo_epochs=c.algorithm.ppo_epochs,
               shared_prompts=c.mode == "rl" and c.algorithm.shared_prompts,
               skip_no_signal_updates=c.algorithm.skip_no_signal_updates, data=data,
               dpo_beta=c.dpo.beta, model=ModelSettings.from_config(c),
               env=EnvSettings.from_config(c), checkpoint=_group(CheckpointSettings, c.checkpoint),
               log=_group(LogSettings, c.log), warm_start=_group(WarmStart, c.warm_start),
               max_consecutive_nonfinite=c.optim.max_consecutive_nonfinite,
               max_logprob_gap=c.rollout.max_logprob_gap)

  def with_model(self, name: str) -> Settings:
    """These settings with the policy at `name` (model.name), e.g. a warm start's export."""
    record = copy.deepcopy(self.record)
    record["model"]["name"] = name
    return dataclasses.replace(self, record=record,
                               model=dataclasses.replace(self.model, name=name))

  def warm_start_run(self, demonstrations: paths.Path) -> Settings:
    """The settings of the run's warm start: SFT of its policy on `demonstrations` for
    warm_start.steps steps (warm_start's batch size and constant learning rate, conversations
    of up to rollout.max_context tokens), with the run's environment and logging, ending in a
    merged export (RL starts from a whole model) and evaluating nothing."""
    sft = ml_collections.ConfigDict(copy.deepcopy(self.record))
    w = sft.warm_start
    sft.mode = "sft"
    sft.steps = w.steps
    sft.warm_start.steps = 0
    sft.data.path = str(demonstrations)
    sft.data.batch_size = w.batch_size
    sft.data.max_length = sft.rollout.max_context
    sft.optim.learning_rate = w.learning_rate
    sft.optim.schedule = "constant"
    sft.optim.warmup_steps = 0
    sft.checkpoint.export_hf = True
    sft.checkpoint.export_format = "merged"
    sft.eval.every = 0
    sft.eval.stages = False
    return Settings.from_config(sft)

  def check_layout(self, mesh: Mesh, process_count: int) -> None:
    """What the config can only be checked against once the mesh and processes are known."""
    r = self.rollout
    process_rows = r.rows // process_count
    if process_rows % r.pipeline_groups:
      raise config_lib.ConfigError(
          f"invalid config: rollout.pipeline_groups={r.pipeline_groups} does not divide "
          f"the {process_rows} trajectories of each of the {process_count} processes")
    if r.wave(process_rows) % r.pipeline_groups:
      raise config_lib.ConfigError(
          f"invalid config: rollout.pipeline_groups={r.pipeline_groups} does not divide "
          f"a wave of {r.wave(process_rows)} of each process's {process_rows} trajectories")
    batch_shards = sharding.batch_shards(mesh)
    minibatch = r.rows // self.num_minibatches
    if minibatch % batch_shards:
      raise config_lib.ConfigError(
          f"invalid config: a minibatch of {minibatch} trajectories (tasks_per_step x "
          f"samples_per_task / num_minibatches) does not split over the {batch_shards} devices "
          "of the mesh's data x fsdp axes; change the batch or mesh.data/mesh.fsdp")
    micro = self.loss.micro_batch_rows
    if micro and micro % batch_shards:
      raise config_lib.ConfigError(
          f"invalid config: algorithm.micro_batch_rows={micro} does not split over the "
          f"{batch_shards} devices of the mesh's data x fsdp axes")
    # Packed rows are padded with empty ones to split over the devices, but micro-batches take
    # every count-th packed row (learner.split_micro_batches), which padding would unbalance.
    if self.shared_prompts and micro and (micro // r.samples_per_task) % batch_shards:
      raise config_lib.ConfigError(
          f"invalid config: the {micro // r.samples_per_task} tasks of a micro-batch "
          f"(algorithm.micro_batch_rows / rollout.samples_per_task) do not split over the "
          f"{batch_shards} devices of the mesh's data x fsdp axes; change them or set "
          "algorithm.shared_prompts=False")

  # --- what a loop opens

  def load_policy(self, model_name: str | None = None, *,
                  training: bool = False) -> tuple[Mesh, Decoder, Tokenizer]:
    """(mesh, model, tokenizer): the policy (model.name, or `model_name`) loaded sharded on
    the configured mesh. model.remat=auto is resolved for the run's update step when
    `training` (see `auto_remat`), and is none otherwise (sampling has no backward pass)."""
    m = self.model
    sharding.initialize_distributed()
    mesh = m.make_mesh()
    dtype = m.matmul_dtype()
    if m.dtype == "auto":
      logging.info("model.dtype=auto: %s, as %s", dtype, hardware.auto_dtype()[1])
    implementation = attention.choose(m.attention)
    if implementation == "splash" and jax.default_backend() != "tpu":
      raise config_lib.ConfigError(
          f"invalid config: model.attention=splash runs a TPU kernel; the backend is "
          f"{jax.default_backend()} (use auto, flash or dense)")
    logging.info("model.attention=%s: %s attention on %s", m.attention, implementation,
                 jax.default_backend())
    model, tokenizer = load_model(model_name or m.name, dtype=jnp.dtype(dtype),
                                  param_dtype=jnp.dtype(m.param_dtype),
                                  remat="none" if m.remat == "auto" else m.remat,
                                  attention=m.attention, mesh=mesh)
    if m.remat == "auto" and training:
      model.remat, why = self.auto_remat(model, mesh)
      logging.info("model.remat=auto: %s, as %s", model.remat, why)
    return mesh, model, tokenizer

  def policy(self, model: Decoder, mesh: Mesh | None) -> Policy:
    """The loaded `model` split into what the run trains and what stays frozen (`Policy`):
    with LoRA, fresh adapters from the run's seed over the frozen model."""
    graphdef, params = nnx.split(model)
    lora, export_format = self.model.lora, self.checkpoint.export_format
    if lora is None:
      return Policy(graphdef, params, None, graphdef, None, export_format)
    adapters = lora_lib.init_adapters(model.config, lora, self.seed, mesh)
    lora_graphdef, adapter_params, base = lora_lib.split(lora_lib.LoraModel(model, adapters))
    merge = jax.jit(functools.partial(lora_lib.merged_params, lora_graphdef),
                    out_shardings=jax.tree.map(lambda x: x.sharding, params))
    return Policy(lora_graphdef, adapter_params, base, graphdef, merge, export_format)

  def dropout_key(self, step: int, update: int) -> jax.Array | None:
    """The key of LoRA's dropout in optimizer update `update` of step `step` (a pure function
    of the seed, so a resumed run drops what an uninterrupted one drops); None without
    dropout."""
    if self.model.lora is None or not self.model.lora.dropout:
      return None
    stream = jax.random.fold_in(jax.random.key(self.seed), DROPOUT_STREAM)
    return jax.random.fold_in(jax.random.fold_in(stream, step), update)

  def update_shape(self) -> tuple[int, int]:
    """(rows, tokens) of the run's largest update step: an RL minibatch of rollout rows packed
    to packed_length(max_context), or an offline batch of data.max_length rows (twice the rows for
    DPO, which scores both sides of each pair)."""
    if self.mode == "rl":
      return self.rollout.rows // self.num_minibatches, packed_length(self.rollout.max_context)
    return self.data.batch_size * (2 if self.mode == "dpo" else 1), self.data.max_length

  def auto_remat(self, model: Decoder, mesh: Mesh) -> tuple[str, str]:
    """(policy, why) for model.remat=auto: the memory planner's `choose_remat` over the
    backend's policies (`memory.remat_preference`) on the update step of `update_shape`, beside
    what stays resident through it (the reference policy; an RL step's whole batch and
    experience). A device's memory is the smallest any process reports, so every process picks
    the same policy."""
    rows, tokens = self.update_shape()
    param_dtype = jnp.dtype(self.model.param_dtype)
    _, params = memory.abstract_params(model.config, mesh, dtype=model.dtype,
                                       param_dtype=param_dtype)
    resident = 0
    # The reference (Policy.reference): of the whole model, or of LoRA's adapters, left out
    # here as small beside the step.
    if (self.loss.uses_reference or self.mode == "dpo") and self.model.lora is None:
      resident += memory.reference_bytes(params, model.dtype)
    if self.mode == "rl":
      resident += memory.device_bytes(memory.abstract_minibatch(mesh, self.rollout.rows, tokens))
    device_bytes, source = hardware.device_memory()
    if jax.process_count() > 1:
      device_bytes = min(multihost.all_gather_objects(device_bytes))
      source += ", the smallest of the processes'"
    step = memory.StepShape(rows, tokens, dtype=model.dtype, param_dtype=param_dtype,
                            attention=model.attention, logits_chunk=self.loss.logprob_chunk,
                            micro_batch_rows=self.loss.micro_batch_rows, lora=self.model.lora)
    peak = lambda remat: memory.plan(model.config, mesh, dataclasses.replace(step, remat=remat)
                                    ).peak_bytes
    remat, why = memory.choose_remat(peak, device_bytes, resident,
                                     memory.remat_preference(jax.default_backend()))
    return remat, f"a {rows} x {tokens} update step: {why} ({source})"

  def chat(self, tokenizer: Tokenizer) -> ChatTemplate:
    """The policy's chat template with model.thinking; a template this project cannot lay out
    (or, thinking off, one without a thinking switch) is a ConfigError."""
    try:
      return tokenizer.chat_template(thinking=self.model.thinking == "on")
    except ValueError as error:
      raise config_lib.ConfigError(
          f"invalid config: model.name={self.model.name!r}, model.thinking="
          f"{self.model.thinking!r}: {error}") from None

  def sampler(self, model: Decoder, mesh: Mesh | None, rows: int) -> Sampler:
    """The sampler for playing `rows` episodes at once: rows / pipeline_groups rows of
    max_context slots each (every group of rows has its own state on it), the KV cache in
    rollout.cache_dtype."""
    return Sampler(model, cache_slots=self.rollout.max_context,
                   max_batch=-(-rows // self.rollout.pipeline_groups),
                   cache_dtype=self.model.cache_dtype or None, mesh=mesh)

  def player(self, sampler: Sampler, params: Any, pool: EnvPool, chat: ChatTemplate,
             sampling: rollout.TurnSampling | None = None) -> rollout.Player:
    """`sampler` with `params` playing `pool`'s environment in the run's context limit and
    pipelined groups, sampling turns as the rollout does (or as `sampling` says)."""
    return rollout.Player(sampler, params, pool, chat, sampling or self.rollout.sampling,
                          self.rollout.max_context, self.rollout.pipeline_groups)

  def checkpointer(self, workdir: pathlib.Path) -> checkpoint.Checkpointer:
    """workdir/checkpoints, saved every checkpoint_every steps (or only at the last step),
    keeping the newest checkpoint.keep."""
    return checkpoint.Checkpointer(workdir / "checkpoints", keep=self.checkpoint.keep,
                                   save_every=self.checkpoint.every or self.steps)

  def metrics_writer(self, workdir: pathlib.Path, start_step: int) -> metrics.MetricsWriter:
    log = self.log
    wandb = (dict(project=log.wandb_project, name=log.wandb_run_name or workdir.name,
                  config=copy.deepcopy(self.record)) if log.wandb else None)
    return metrics.MetricsWriter(workdir, tensorboard=log.tensorboard, resume_step=start_step,
                                 wandb=wandb, wandb_pages={"viewer": viewer.page})

  def progress(self, keys: tuple[str, ...], initial: int,
               shown: bool = True) -> metrics.ProgressBar:
    """The console progress of the run's steps, off if log.progress_bar is or not `shown`."""
    return metrics.ProgressBar(self.steps, keys=keys, initial=initial,
                               enabled=None if self.log.progress_bar and shown else False)

  def meta(self, step: int, **extra: Any) -> dict[str, Any]:
    """A checkpoint's meta: the step, `extra`, the seed and the config."""
    return {"step": step, **extra, "seed": self.seed, "config": copy.deepcopy(self.record)}

  # --- the end of each step, and of the run

  def check_health(self, fetched: dict[str, Any]) -> None:
    """Stops the run with a clear message when the numbers say it is broken."""
    most_nonfinite = self.max_consecutive_nonfinite
    if fetched.get("nonfinite_steps", 0) >= most_nonfinite:
      raise FloatingPointError(
          f"{int(fetched['nonfinite_steps'])} consecutive updates had non-finite gradients; "
          f"stopping (optim.max_consecutive_nonfinite={most_nonfinite})")
    gap, most_gap = fetched.get("logprob_gap_mean"), self.max_logprob_gap
    if gap is not None and gap > most_gap:
      raise RuntimeError(
          f"the sampler's and the learner's log-probs differ by {gap:.3g} nats per token on "
          f"average (> rollout.max_logprob_gap={most_gap}): the sampled tokens are no longer "
          "on-policy")

  def export_policy(self, model: Decoder | lora_lib.Adapters, tokenizer: Tokenizer,
                    workdir: pathlib.Path) -> None:
    """The trained policy (`Policy.exported`) in workdir/export, in checkpoint.export_dtype:
    a decoder as a Hugging Face directory, LoRA's adapters as a PEFT adapter directory; the
    tokenizer beside either."""
    if not paths.is_remote(workdir):
      dtype = self.checkpoint.export_dtype
      if isinstance(model, lora_lib.Adapters):
        lora_lib.save_peft(model, workdir / "export", self.model.name, dtype=dtype)
      else:
        weights.save_hf(model, workdir / "export", dtype=dtype)
      tokenizer.save_pretrained(workdir / "export")
      return
    with tempfile.TemporaryDirectory() as local:  # Written locally, then copied file by file.
      self.export_policy(model, tokenizer, pathlib.Path(local))
      paths.copy_tree(local, workdir / "export")


# fold_in of the seed's key that LoRA's dropout keys derive from: apart from the steps' rollout
# keys (fold_in(seed key, step)) and the evaluation's (1 << 30).
DROPOUT_STREAM = 1 << 29


def _lora_settings(c: ml_collections.ConfigDict) -> lora_lib.LoraSettings | None:
  lora = c.model.lora
  if not lora.rank:
    return None
  return lora_lib.LoraSettings(rank=lora.rank, alpha=float(lora.alpha), targets=tuple(lora.targets),
                               dropout=float(lora.dropout))


@dataclasses.dataclass(frozen=True)
class Policy:
  """The policy a loop trains, split into the parameters it differentiates and those it keeps
  frozen, and what the sampler and the export see of it.

  Full fine-tuning trains the decoder's parameters (`frozen` is None) and the sampler reads
  them as they are. LoRA trains adapters over the frozen base (agentgym_jax/models/lora.py):
  `params` are the adapters, `frozen` the base, the learner's model is a lora.LoraModel, and
  the sampler runs the base with the adapters merged in, computed once per call of
  `sampler_params`. Only `params` (and the optimizer's state of them) are checkpointed.

  Attributes:
    graphdef: the learner's model graph (the Decoder's, or the LoraModel's).
    params: the trained parameters as the run starts (before any resume).
    frozen: LoRA's base parameters, or None.
    decoder_graphdef: the plain Decoder's graph, the sampler's and the merged export's.
    merge: LoRA's jitted (adapters, base) -> decoder parameters, on the base's shardings.
    export_format: checkpoint.export_format.
  """

  graphdef: nnx.GraphDef
  params: nnx.State
  frozen: nnx.State | None
  decoder_graphdef: nnx.GraphDef
  merge: Callable[[nnx.State, nnx.State], nnx.State] | None
  export_format: str

  def reference(self, dtype: Any) -> nnx.State:
    """The frozen reference of a KL loss or DPO: the trained parameters as the run starts, in
    buffers of its own (the update donates the policy's). A model's copy keeps its matmul
    weights in the matmul `dtype` (`decoder.matmul_copy`: the same log-probs, half the bytes
    in bf16); LoRA's is the initial adapters, whose zero B leaves the base exactly (no second
    copy of the model)."""
    if self.frozen is not None:
      return jax.tree.map(jnp.copy, self.params)
    return decoder.matmul_copy(self.params, dtype)

  def networks(self, value_graphdef: nnx.GraphDef | None = None) -> learner.Networks:
    """What the learner's passes run besides the trained parameters: this policy's graph and
    frozen base, with a value head's graph (PPO's critic) if given."""
    return learner.Networks(self.graphdef, value_graphdef, self.frozen)

  def sampler_params(self, params: nnx.State) -> nnx.State:
    """The decoder's parameters of the policy whose trained parameters are `params`."""
    return params if self.frozen is None else self.merge(params, self.frozen)

  def export_params(self, params: nnx.State) -> nnx.State:
    """What the export writes: the adapters (peft), else the decoder's parameters."""
    return params if self.export_format == "peft" else self.sampler_params(params)

  def exported(self, export_params: nnx.State) -> Decoder | lora_lib.Adapters:
    """The module of `export_params` (possibly a process-local copy) for `export_policy`."""
    if self.export_format == "peft":
      return nnx.merge(self.graphdef, export_params, self.frozen).adapters
    return nnx.merge(self.decoder_graphdef, export_params)


def _loss_config(c: ml_collections.ConfigDict) -> learner.LossConfig:
  a = c.algorithm
  if c.mode != "rl":
    return learner.LossConfig(logprob_chunk=a.logprob_chunk)
  estimator = rl.get_advantage_estimator(a.advantage)
  options = sorted((argument, a[key]) for argument, key in estimator.hyperparameters)
  clip_low, clip_high = rl.get_policy_loss(a.policy_loss).clip_keys
  return learner.LossConfig(
      advantage_estimator=a.advantage, advantage_options=tuple(options),
      negative_advantage_weight=a.negative_advantage_weight, policy_loss=a.policy_loss,
      clip_eps_low=a[clip_low], clip_eps_high=a[clip_high], dual_clip_c=a.dual_clip_c or None,
      aggregation=a.aggregation, loss_scale_tokens=_loss_scale_tokens(c),
      rollout_correction=a.rollout_correction, rollout_correction_cap=a.rollout_correction_cap,
      kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_in_reward_coef=a.kl_in_reward_coef,
      kl_in_reward_estimator=a.kl_in_reward_estimator, entropy_coef=a.entropy_coef,
      value_coef=a.value_coef, value_clip_eps=a.value_clip_eps, temperature=c.rollout.temperature,
      logprob_chunk=a.logprob_chunk, micro_batch_rows=a.micro_batch_rows)


def _loss_scale_tokens(c: ml_collections.ConfigDict) -> float | None:
  """A scaled aggregation's divisor: algorithm.loss_scale_tokens, or if 0 the most tokens a
  trajectory can have trained (max_new_tokens a turn, the horizon's largest cap of turns);
  None for the other aggregations."""
  a = c.algorithm
  if a.aggregation not in rl.SCALED_AGGREGATIONS:
    return None
  if a.loss_scale_tokens:
    return float(a.loss_scale_tokens)
  max_turns = horizon.make_horizon_schedule(config_lib.horizon_options(c)).max_turns
  return float(c.rollout.max_new_tokens * max_turns)


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


def configured_optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The run's optimizer from config.optim (AdamW after clipping, non-finite steps skipped)."""
  return learner.make_optimizer(learning_rate_schedule(c), weight_decay=c.optim.weight_decay,
                                b1=c.optim.b1, b2=c.optim.b2, eps=c.optim.eps,
                                grad_clip=c.optim.grad_clip,
                                max_consecutive_nonfinite=c.optim.max_consecutive_nonfinite)


@dataclasses.dataclass
class RunState:
  """What a checkpoint restores: the trained parameters and the optimizer state."""

  params: nnx.State
  value_params: nnx.State | None
  opt_state: optax.OptState

  def tree(self) -> dict[str, Any]:
    return {"params": self.params, "value_params": self.value_params, "opt_state": self.opt_state}


def place_optimizer_state(opt_state: optax.OptState, shardings: Any, *,
                          on_host: bool) -> optax.OptState:
  """The optimizer state on `shardings`' devices, in their memory or (`on_host`) in the host
  memory pinned for them (memory kind pinned_host): an RL run with optim.offload_state keeps
  it there between updates, leaving device memory to the rollout, at the cost of one transfer
  each way per step. The values do not change."""
  kind = "pinned_host" if on_host else "device"
  return jax.device_put(opt_state, jax.tree.map(lambda s: s.with_memory_kind(kind), shardings))


def resume(checkpointer: checkpoint.Checkpointer,
           state: RunState) -> tuple[RunState, int, dict[str, Any]]:
  """(state, first step to run, checkpoint meta) from the newest complete checkpoint, or the
  given state at step 0. Step k's checkpoint is written after k steps. A resumed run says so on
  stdout (process 0), with the launch scripts' library logs hidden."""
  if checkpointer.latest_step() is None:
    return state, 0, {}
  restored, meta = checkpointer.restore(state.tree())
  if jax.process_index() == 0:
    print(f"resumed from step {int(meta['step'])} of {checkpointer.directory}", flush=True)
  return (RunState(restored["params"], restored["value_params"],
                   restored["opt_state"]), int(meta["step"]), meta)


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
