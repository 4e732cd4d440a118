"""A run's settings: one frozen group per config group, each built and validated from the
config in its constructor (`from_config`), and `Settings`, which holds them.

`Settings.from_config` is the only place a config's values are checked and translated; past it
no `ConfigDict` travels. A bad value is a `config.ConfigError` of one line naming the key. A
component receives its group (the sampler and player their `RolloutSettings`, the checkpointer
its `CheckpointSettings`, ...), and a group builds what is made only of its own values.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import itertools
import math
import os
import pathlib
from typing import Any, Mapping, Sequence

import jax
import ml_collections
import optax
from jax.sharding import Mesh

from agentgym_jax import checkpoint, hardware, horizon, learner, paths, rl, rollout, sharding
from agentgym_jax import judge as judge_lib
from agentgym_jax.config import CACHE_DTYPES, DTYPES, EXPORT_FORMATS, ConfigError
from agentgym_jax.models import attention, decoder, lora as lora_lib
from agentgym_jax.models.tokenizer import ChatTemplate, Tokenizer
from agentgym_jax.sampling import Sampler
from environments import base as env_base
from environments.latency import StepLatency
from environments.mixture import MixturePool
from environments.pool import EnvPool, Environment


def check(condition: bool, message: str) -> None:
  """Raises ConfigError("invalid config: `message`") unless `condition`."""
  if not condition:
    raise ConfigError(f"invalid config: {message}")


# --- the groups --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """The policy (config groups model and mesh): the checkpoint `name`, its numerics as
  configured (`dtype` auto is resolved by `matmul_dtype`), the learner's attention and remat,
  model.thinking (on | off), the (data, fsdp, tensor) mesh, LoRA (None: every weight is
  trained) and the sampler's own devices and tensor parallelism (`rollout_mesh`: (0, 1) shares
  the learner's mesh)."""

  name: str
  dtype: str
  param_dtype: str
  attention: str
  remat: str
  thinking: str
  mesh: tuple[int, int, int]
  lora: lora_lib.LoraSettings | None
  rollout_mesh: tuple[int, int] = (0, 1)

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> ModelSettings:
    m = c.model
    check(m.dtype in DTYPES + ("auto",),
          f"model.dtype={m.dtype!r} is not one of {DTYPES + ('auto',)}")
    check(m.param_dtype in DTYPES, f"model.param_dtype={m.param_dtype!r} is not one of {DTYPES}")
    remats = [*decoder.REMAT_POLICIES, "auto"]
    check(m.remat in remats, f"model.remat={m.remat!r} is not one of {remats}")
    check(m.attention in attention.IMPLEMENTATIONS,
          f"model.attention={m.attention!r} is not one of {attention.IMPLEMENTATIONS}")
    check(m.thinking in ("on", "off"), f"model.thinking={m.thinking!r} is not 'on' or 'off'")
    for axis in ("data", "fsdp", "tensor"):
      value = c.mesh[axis]
      check(value == -1 or value > 0, f"mesh.{axis}={value} must be > 0 or -1")
    devices, tensor = c.mesh.rollout_devices, c.mesh.rollout_tensor
    check(
        devices >= 0 and tensor >= 1 and devices % tensor == 0,
        f"mesh.rollout_devices={devices} must be >= 0 (0: the sampler shares the learner's "
        f"mesh) and a multiple of mesh.rollout_tensor={tensor} >= 1")
    return cls(name=m.name, dtype=m.dtype, param_dtype=m.param_dtype, attention=m.attention,
               remat=m.remat, thinking=m.thinking, mesh=(c.mesh.data, c.mesh.fsdp, c.mesh.tensor),
               lora=_lora(m.lora), rollout_mesh=(devices, tensor))

  def matmul_dtype(self) -> str:
    """model.dtype with auto resolved for this machine (hardware.matmul_dtype)."""
    return hardware.matmul_dtype(self.dtype)

  def make_mesh(self) -> Mesh:
    """The learner's mesh: over every device, or those the sampler's mesh leaves."""
    return sharding.make_mesh(*self.mesh, devices=self._split_devices()[0])

  def make_rollout_mesh(self) -> Mesh | None:
    """The sampler's own mesh (mesh.rollout_devices), or None: it shares the learner's."""
    devices, tensor = self.rollout_mesh
    return sharding.make_mesh(1, -1, tensor, devices=self._split_devices()[1]) if devices else None

  def _split_devices(self) -> tuple[list[jax.Device], list[jax.Device]]:
    devices, count = jax.devices(), self.rollout_mesh[0]
    if not count:
      return devices, []
    check(count < len(devices),
          f"mesh.rollout_devices={count} leaves none of the {len(devices)} devices to the learner")
    return devices[:-count], devices[-count:]

  def chat(self, tokenizer: Tokenizer) -> ChatTemplate:
    """The policy's chat template with model.thinking; a template this project cannot lay out
    (or, thinking off, one without a thinking switch) is a ConfigError."""
    try:
      return tokenizer.chat_template(thinking=self.thinking == "on")
    except ValueError as error:
      raise ConfigError(f"invalid config: model.name={self.name!r}, model.thinking="
                        f"{self.thinking!r}: {error}") from None


def _lora(lora: ml_collections.ConfigDict) -> lora_lib.LoraSettings | None:
  """model.lora's settings, checked; None when its rank is 0 (full fine-tuning)."""
  check(
      isinstance(lora.rank, int) and lora.rank >= 0,
      f"model.lora.rank={lora.rank!r} must be an integer >= 0 (0: off)")
  check(lora.alpha > 0, f"model.lora.alpha={lora.alpha} must be > 0")
  check(0 <= lora.dropout < 1, f"model.lora.dropout={lora.dropout} must be in [0, 1)")
  targets = lora.targets
  check(
      isinstance(targets, (tuple, list)) and len(targets) > 0,
      f"model.lora.targets={targets!r} must be a non-empty tuple of projections, some of "
      f"{lora_lib.TARGETS}")
  unknown = [t for t in targets if t not in lora_lib.TARGETS]
  check(not unknown,
        f"model.lora.targets: {', '.join(map(repr, unknown))} is not one of {lora_lib.TARGETS}")
  check(
      len(set(targets)) == len(targets), f"model.lora.targets={tuple(targets)} names a "
      "projection twice")
  if not lora.rank:
    return None
  return lora_lib.LoraSettings(rank=lora.rank, alpha=float(lora.alpha), targets=tuple(targets),
                               dropout=float(lora.dropout))


# env.name of a run on a mixture of environments (env.mixture).
MIXTURE = "mixture"
# The keys of an env.mixture component.
MIXTURE_KEYS = ("name", "weight", "options", "horizon", "label")


@dataclasses.dataclass(frozen=True)
class MixtureComponent:
  """One environment of a mixture (env.mixture): its `label` (its name in metrics and task
  categories), its registered `name`, its adapters' keyword arguments (`options`, with the
  run's action format when it is not react), its `weight` in the draws and its own turn cap
  `max_turns` (None: the step's)."""

  label: str
  name: str
  options: dict[str, Any]
  weight: float
  max_turns: int | None


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """The environment (config group env): its registered `name`, its adapters' keyword arguments
  (`options`: env.options, and the action format when it is not react), how its episodes run
  (backend, step_timeout, an added step latency) and how its faults enter the loss
  (failed_episodes); or, with `mixture` (env.mixture), the environments of a mixture, `name`
  then MIXTURE and `options` empty."""

  name: str
  options: dict[str, Any]
  action_format: str
  backend: str
  step_timeout: float
  failed_episodes: str
  latency: StepLatency | None = None
  mixture: tuple[MixtureComponent, ...] = ()

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> EnvSettings:
    e = c.env
    check(
        isinstance(e.mixture, (tuple, list)),
        f"env.mixture={e.mixture!r} must be a tuple of dicts, one for each environment (() for "
        "env.name alone)")
    if e.mixture:
      check(e.name == MIXTURE,
            f"env.name={e.name!r}: a run on env.mixture has env.name={MIXTURE!r}")
    else:
      check(e.name != MIXTURE, f"env.name={MIXTURE!r} plays the environments of env.mixture, which "
            "is empty")
      check(e.name in env_base.registered(),
            f"env.name={e.name!r} is not one of {env_base.registered()}")
    check(e.backend in ("thread", "process"),
          f"env.backend={e.backend!r} is not 'thread' or 'process'")
    check(e.step_timeout > 0, f"env.step_timeout={e.step_timeout} must be > 0")
    check(e.failed_episodes in ("exclude", "zero_reward"),
          f"env.failed_episodes={e.failed_episodes!r} is not 'exclude' or 'zero_reward'")
    check(e.action_format in env_base.ACTION_FORMATS,
          f"env.action_format={e.action_format!r} is not one of {env_base.ACTION_FORMATS}")
    mixture = _mixture(e)
    options = {} if mixture else _adapter_options(e.name, e.options.to_dict(), e.action_format,
                                                  "env.name", "env.options.")
    latency = None
    if e.latency.mean_s:
      check(
          e.latency.mean_s > 0 and e.latency.sigma >= 0 and e.latency.max_s >= e.latency.mean_s,
          f"env.latency: mean_s={e.latency.mean_s}, sigma={e.latency.sigma} and max_s="
          f"{e.latency.max_s} need mean_s >= 0 (0: none), sigma >= 0 and max_s >= mean_s")
      latency = StepLatency(e.latency.mean_s, e.latency.sigma, e.latency.max_s, c.seed)
    return cls(name=e.name, options=options, action_format=e.action_format, backend=e.backend,
               step_timeout=e.step_timeout, failed_episodes=e.failed_episodes, latency=latency,
               mixture=mixture)

  def pool(self, rows: int) -> EnvPool | MixturePool:
    """A pool of `rows` episodes of the environment; of a mixture, the pool of its components'
    pools, each `rows` slots wide."""
    if not self.mixture:
      return self._pool(self.name, self.options, rows)
    return MixturePool([
        Environment(m.label, self._pool(m.name, m.options, rows), m.max_turns) for m in self.mixture
    ])

  def _pool(self, name: str, options: dict[str, Any], rows: int) -> EnvPool:
    return EnvPool(name, rows, options=options, backend=self.backend,
                   step_timeout_s=self.step_timeout, latency=self.latency)


def _adapter_options(name: str, options: dict[str, Any], action_format: str, where: str,
                     prefix: str) -> dict[str, Any]:
  """The keyword arguments of environment `name`'s adapters (the config key `where` names it):
  `options` (keys `prefix` + key, e.g. "env.options.goals"), checked against its constructor,
  with `action_format` unless that is react."""
  check(
      action_format == "react" or name in env_base.TOOL_CALL_ENVS,
      f"env.action_format={action_format!r}: env {name!r} publishes no tools "
      f"(those that do: {', '.join(env_base.TOOL_CALL_ENVS)})")
  check("action_format" not in options, f"set env.action_format, not {prefix}action_format")
  try:
    problem = env_options_problem(name, options, prefix, hidden=("action_format",))
  except env_base.AdapterImportError as error:
    raise ConfigError(f"invalid config: {where}={name!r}: {error}") from None
  check(problem is None, str(problem))
  if name == "textcraft" and "goals" in options:
    from environments.textcraft import env as textcraft  # pylint: disable=import-outside-toplevel
    check(options["goals"] in textcraft.GOAL_SETS,
          f"{prefix}goals={options['goals']!r} is not one of {textcraft.GOAL_SETS}")
  return {**options, **({} if action_format == "react" else {"action_format": action_format})}


def _mixture(e: ml_collections.ConfigDict) -> tuple[MixtureComponent, ...]:
  """The components of env.mixture (config group `e`, env), each checked: its keys, a registered
  name, a weight > 0, options its adapter takes, a turn cap >= 1 and a label of its own."""
  if e.mixture:
    check(
        not e.options.to_dict(), "env.options are env.name's adapter's; the environments of "
        "env.mixture take theirs in their own \"options\"")
  components: list[MixtureComponent] = []
  for i, component in enumerate(e.mixture):
    where = f"env.mixture[{i}]"
    if isinstance(component, ml_collections.ConfigDict):
      component = component.to_dict()
    check(
        isinstance(component, Mapping) and "name" in component and "weight" in component,
        f"{where}={component!r} must be a dict with a name and a weight (keys: "
        f"{', '.join(MIXTURE_KEYS)})")
    unknown = sorted(set(component) - set(MIXTURE_KEYS))
    check(not unknown, f"{where} has unknown keys {unknown}; its keys: {', '.join(MIXTURE_KEYS)}")
    name, weight = component["name"], component["weight"]
    check(name in env_base.registered(),
          f"{where}.name={name!r} is not one of {env_base.registered()}")
    check(
        isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight < math.inf,
        f"{where}.weight={weight!r} must be a number > 0")
    label = component.get("label", name)
    check(
        isinstance(label, str) and label and "/" not in label,
        f"{where}.label={label!r} must be a non-empty string without '/' (metrics and "
        "categories put one after it)")
    check(
        label not in [m.label for m in components],
        f"{where}: the label {label!r} is another component's; give one of them a distinct "
        "\"label\"")
    horizon = component.get("horizon")
    check(
        horizon is None
        or (isinstance(horizon, int) and not isinstance(horizon, bool) and horizon >= 1),
        f"{where}.horizon={horizon!r} must be an integer >= 1")
    options = component.get("options", {})
    if isinstance(options, ml_collections.ConfigDict):
      options = options.to_dict()
    check(isinstance(options, Mapping), f"{where}.options={options!r} must be a dict")
    components.append(
        MixtureComponent(
            label, name,
            _adapter_options(name, dict(options), e.action_format, f"{where}.name",
                             f"{where}.options."), float(weight), horizon))
  return tuple(components)


def env_options_problem(name: str, options: Mapping[str, Any], prefix: str,
                        hidden: Sequence[str] = ()) -> str | None:
  """What is wrong with `options` as the keyword arguments of environment `name`'s adapter
  constructor (environments.base.factory), or None: a key it does not take, or one it needs
  that is missing, named `prefix` + key (e.g. "env.options.goals"), with the keys it takes
  (less `hidden`, those set elsewhere). An adapter that takes **kwargs takes any key."""
  factory = env_base.factory(name)
  try:
    parameters = list(inspect.signature(factory).parameters.values())
  except (TypeError, ValueError):  # A factory without a signature Python can read.
    return None
  if any(p.kind is p.VAR_KEYWORD for p in parameters):
    return None
  keywords = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  takes = ", ".join(p.name for p in keywords if p.name not in hidden) or "none"
  for key in options:
    if key not in {p.name for p in keywords}:
      return f"{prefix}{key}: environment {name!r} takes no option {key!r}; its options: {takes}"
  for p in keywords:
    if p.default is p.empty and p.name not in options:
      return f"{prefix}{p.name} is required by environment {name!r}; its options: {takes}"
  return None


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
    refill: whether a row whose episode ends takes the next one at once (rollout.collect).
    decode_chunk: the tokens of a reply one decode call samples at most (0: the whole reply).
    max_staleness: how many updates the policy playing a step may be behind the one training
      on it (rollout_queue.py; 0: synchronous).
    partial_rollouts: the rounds of replies (decode calls that start replies) after which a
      step's rollout moves to the next newer policy (rollout.PolicySwitches; 0: never).
    cache_dtype: the KV cache's dtype ("": the model's matmul dtype).
    context: what a row's context holds of its episode (rollout.ContextPolicy).
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
  refill: bool
  max_staleness: int
  cache_dtype: str
  context: rollout.ContextPolicy
  partial_rollouts: int = 0
  decode_chunk: int = 0

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> RolloutSettings:
    r = c.rollout
    for key in ("tasks_per_step", "samples_per_task", "max_new_tokens", "max_context"):
      check(r[key] > 0, f"rollout.{key}={r[key]} must be > 0")
    check(
        r.max_new_tokens < r.max_context,
        f"rollout.max_new_tokens={r.max_new_tokens} must be < rollout.max_context="
        f"{r.max_context}")
    check(r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0")
    check(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]")
    check(r.top_k >= 0, f"rollout.top_k={r.top_k} must be >= 0")
    check(r.pipeline_groups >= 1, f"rollout.pipeline_groups={r.pipeline_groups} must be >= 1")
    check(isinstance(r.refill, bool), f"rollout.refill={r.refill!r} must be True or False")
    check(
        isinstance(r.max_staleness, int) and r.max_staleness >= 0,
        f"rollout.max_staleness={r.max_staleness!r} must be an integer >= 0")
    check(
        isinstance(r.partial_rollouts, int) and r.partial_rollouts >= 0,
        f"rollout.partial_rollouts={r.partial_rollouts!r} must be an integer >= 0 (0: off)")
    check(
        not r.partial_rollouts or r.max_staleness > 0,
        f"rollout.partial_rollouts={r.partial_rollouts} moves a stale rollout to newer policies: "
        "it needs rollout.max_staleness > 0")
    check(
        isinstance(r.decode_chunk, int) and r.decode_chunk >= 0,
        f"rollout.decode_chunk={r.decode_chunk!r} must be an integer >= 0 (0: a whole reply)")
    check(
        not (r.decode_chunk and r.partial_rollouts),
        f"rollout.partial_rollouts={r.partial_rollouts} switches policies after a count of "
        f"decode calls, which with rollout.decode_chunk={r.decode_chunk} depends on when env "
        "steps come back: set one of them to 0")
    check(
        r.wave_rows >= 0 and r.wave_rows % r.pipeline_groups == 0,
        f"rollout.wave_rows={r.wave_rows} must be 0 (every row at once) or a positive multiple "
        f"of rollout.pipeline_groups={r.pipeline_groups}")
    trajectories = r.tasks_per_step * r.samples_per_task
    check(
        trajectories % r.pipeline_groups == 0,
        f"rollout.pipeline_groups={r.pipeline_groups} does not divide the {trajectories} "
        "trajectories per step")
    check(r.cache_dtype in CACHE_DTYPES,
          f"rollout.cache_dtype={r.cache_dtype!r} is not one of {CACHE_DTYPES}")
    check(r.context in rollout.CONTEXTS,
          f"rollout.context={r.context!r} is not one of {rollout.CONTEXTS}")
    check(
        isinstance(r.context_turns, int) and r.context_turns >= 1,
        f"rollout.context_turns={r.context_turns!r} must be an integer >= 1")
    check(r.max_sampling_rounds >= 1,
          f"rollout.max_sampling_rounds={r.max_sampling_rounds} must be >= 1")
    check(r.task_sampling in ("permutation", "learnability"),
          f"rollout.task_sampling={r.task_sampling!r} is not 'permutation' or 'learnability'")
    check(
        r.task_sampling_floor > 0,
        f"rollout.task_sampling_floor={r.task_sampling_floor} must be > 0 (every task reachable)")
    check(0 < r.task_sampling_rate <= 1,
          f"rollout.task_sampling_rate={r.task_sampling_rate} must be in (0, 1]")
    check(
        not r.dynamic_sampling or r.samples_per_task > 1,
        "rollout.dynamic_sampling keeps the groups whose rewards differ: "
        "rollout.samples_per_task must be > 1")
    check(
        isinstance(r.curriculum, (tuple, list)) and all(
            isinstance(stage, (tuple, list)) and stage and all(isinstance(n, str) for n in stage)
            for stage in r.curriculum),
        f"rollout.curriculum={r.curriculum!r} must be a tuple of non-empty tuples of category "
        "names, one a horizon stage, e.g. (('depth1',), ('depth1', 'depth2'))")
    check(
        not (r.curriculum and c.env.mixture), "rollout.curriculum draws from one environment's "
        "categories; a mixture (env.mixture) draws from every component's train tasks")
    return cls(sampling=_turn_sampling(c, r.temperature), tasks_per_step=r.tasks_per_step,
               samples_per_task=r.samples_per_task, dynamic_sampling=r.dynamic_sampling,
               max_sampling_rounds=r.max_sampling_rounds, curriculum=tuple(
                   tuple(stage) for stage in r.curriculum), task_sampling=r.task_sampling,
               task_sampling_floor=r.task_sampling_floor, task_sampling_rate=r.task_sampling_rate,
               max_context=r.max_context, pipeline_groups=r.pipeline_groups, wave_rows=r.wave_rows,
               refill=r.refill, max_staleness=r.max_staleness, cache_dtype=r.cache_dtype,
               context=rollout.ContextPolicy(r.context, r.context_turns),
               partial_rollouts=r.partial_rollouts, decode_chunk=r.decode_chunk)

  @property
  def rows(self) -> int:
    """Trajectories per step: tasks_per_step x samples_per_task."""
    return self.tasks_per_step * self.samples_per_task

  def wave(self, rows: int) -> int:
    """How many of a process's `rows` it plays at once: rollout.wave_rows, at most `rows`."""
    return min(self.wave_rows or rows, rows)

  def sampler(self, model: decoder.Decoder, mesh: Mesh | None, rows: int) -> Sampler:
    """The sampler for playing `rows` episodes at once: rows / pipeline_groups rows of
    max_context slots each (every group of rows has its own state on it), the KV cache in
    rollout.cache_dtype."""
    return Sampler(model, cache_slots=self.max_context, max_batch=-(-rows // self.pipeline_groups),
                   cache_dtype=self.cache_dtype or None, mesh=mesh)

  def player(self, sampler: Sampler, params: Any, pool: EnvPool, chat: ChatTemplate,
             sampling: rollout.TurnSampling | None = None) -> rollout.Player:
    """`sampler` with `params` playing `pool`'s environment in the run's context limit and
    pipelined groups, sampling turns as the rollout does (or as `sampling` says)."""
    return rollout.Player(sampler, params, pool, chat, sampling or self.sampling, self.max_context,
                          self.pipeline_groups, self.refill, self.context,
                          decode_chunk=self.decode_chunk)


def _turn_sampling(c: ml_collections.ConfigDict, temperature: float) -> rollout.TurnSampling:
  """A turn sampled as the rollout samples (max_new_tokens, top_p, top_k) at `temperature`."""
  r = c.rollout
  return rollout.TurnSampling(max_new_tokens=r.max_new_tokens, temperature=temperature,
                              top_p=r.top_p, top_k=r.top_k)


def horizon_schedule(c: ml_collections.ConfigDict) -> horizon.HorizonSchedule:
  """The ScalingInter-RL schedule of config group horizon: its kind, with the fields that kind
  reads (stepwise: caps, every; linear: initial, increment, every, maximum; fixed: turns)."""
  kind = c.horizon.kind
  check(kind in horizon.HORIZON_SCHEDULES,
        f"horizon.kind={kind!r} is not one of {sorted(horizon.HORIZON_SCHEDULES)}")
  options = {f.name: c.horizon[f.name] for f in dataclasses.fields(horizon.HORIZON_SCHEDULES[kind])}
  if "caps" in options:
    options["caps"] = tuple(options["caps"])
  try:
    return horizon.make_horizon_schedule({"kind": kind, **options})
  except (ValueError, TypeError) as error:
    raise ConfigError(f"invalid config: horizon: {error}") from None


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
  """How a step updates the policy (config groups algorithm and optim).

  Attributes:
    loss: the static loss settings compiled into the update (offline modes read only the
      log-prob chunk and score the model's own distribution, temperature 1).
    optimizer: AdamW over the run's optimizer updates, after clipping, non-finite ones skipped.
    offload_optimizer: whether the optimizer state waits in pinned host memory between RL
      updates (optim.offload_state).
    num_minibatches, ppo_epochs: an RL step's updates.
    shared_prompts: whether the learner packs each task's samples as one row (batch.py).
    skip_no_signal_updates: whether a step without learning signal skips its update
      (trainer.py).
    scoring: which episodes the loss leaves out and the rewards of the others: env faults as
      env.failed_episodes says, truncations as algorithm.truncated_episodes, and
      algorithm.overlong_buffer's penalty (rollout.EpisodeScoring).
  """

  loss: learner.LossConfig
  optimizer: optax.GradientTransformation
  offload_optimizer: bool
  num_minibatches: int
  ppo_epochs: int
  shared_prompts: bool
  skip_no_signal_updates: bool
  scoring: rollout.EpisodeScoring

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict, rollout_settings: RolloutSettings,
                  max_turns: int, failed_episodes: str) -> UpdateSettings:
    """The update of config `c`, whose steps play as `rollout_settings` says, whose horizon's
    largest cap is `max_turns` and whose env faults enter the loss as `failed_episodes` says."""
    _check_algorithm(c, rollout_settings)
    _check_optim(c)
    a = c.algorithm
    return cls(loss=_loss(c, rollout_settings.sampling, max_turns), optimizer=_optimizer(c),
               offload_optimizer=c.optim.offload_state, num_minibatches=a.num_minibatches,
               ppo_epochs=a.ppo_epochs, shared_prompts=c.mode == "rl" and a.shared_prompts,
               skip_no_signal_updates=a.skip_no_signal_updates,
               scoring=_scoring(a, failed_episodes, rollout_settings.sampling.max_new_tokens))


def _scoring(a: ml_collections.ConfigDict, failed_episodes: str,
             max_new_tokens: int) -> rollout.EpisodeScoring:
  """How episodes enter the loss (config group `a`, algorithm), for replies of up to
  `max_new_tokens` tokens."""
  buffer = a.overlong_buffer
  check(a.truncated_episodes in ("fail", "mask"),
        f"algorithm.truncated_episodes={a.truncated_episodes!r} is not 'fail' or 'mask'")
  check(
      0 <= buffer.length <= max_new_tokens,
      f"algorithm.overlong_buffer.length={buffer.length} must be in [0, rollout.max_new_tokens"
      f" = {max_new_tokens}] (0: off)")
  check(buffer.penalty_factor >= 0,
        f"algorithm.overlong_buffer.penalty_factor={buffer.penalty_factor} must be >= 0")
  overlong = None
  if buffer.length:
    overlong = rollout.OverlongBuffer(buffer.length, buffer.penalty_factor, max_new_tokens)
  return rollout.EpisodeScoring(failed_episodes, a.truncated_episodes, overlong)


def _check_algorithm(c: ml_collections.ConfigDict, r: RolloutSettings) -> None:
  a = c.algorithm
  check(a.advantage in rl.ADVANTAGE_ESTIMATORS,
        f"algorithm.advantage={a.advantage!r} is not one of {sorted(rl.ADVANTAGE_ESTIMATORS)}")
  check(a.aggregation in rl.AGGREGATIONS,
        f"algorithm.aggregation={a.aggregation!r} is not one of {sorted(rl.AGGREGATIONS)}")
  for key in ("kl_estimator", "kl_in_reward_estimator"):
    check(a[key] in rl.KL_ESTIMATORS,
          f"algorithm.{key}={a[key]!r} is not one of {sorted(rl.KL_ESTIMATORS)}")
  check(a.grpo_std in ("population", "unbiased"),
        f"algorithm.grpo_std={a.grpo_std!r} is not 'population' or 'unbiased'")
  check(a.grpo_eps >= 0, f"algorithm.grpo_eps={a.grpo_eps} must be >= 0")
  check(a.policy_loss in rl.POLICY_LOSSES,
        f"algorithm.policy_loss={a.policy_loss!r} is not one of {sorted(rl.POLICY_LOSSES)}")
  for key in ("clip_eps_low", "clip_eps_high", "gspo_clip_eps_low", "gspo_clip_eps_high",
              "cispo_clip_eps_low", "cispo_clip_eps_high"):
    check(a[key] > 0, f"algorithm.{key}={a[key]} must be > 0")
  check(a.cispo_clip_eps_low <= 1,
        f"algorithm.cispo_clip_eps_low={a.cispo_clip_eps_low} must be <= 1 (1: no lower bound)")
  check(a.gigpo_step_weight >= 0, f"algorithm.gigpo_step_weight={a.gigpo_step_weight} must be >= 0")
  check(a.reward_placement in rl.REWARD_PLACEMENTS,
        f"algorithm.reward_placement={a.reward_placement!r} is not one of {rl.REWARD_PLACEMENTS}")
  placing = sorted(name for name, entry in rl.ADVANTAGE_ESTIMATORS.items()
                   if ("reward_placement", "reward_placement") in entry.hyperparameters)
  check(
      a.reward_placement == "outcome" or a.advantage in placing,
      f"algorithm.reward_placement={a.reward_placement!r} needs a token-level estimator, one of "
      f"{placing}; {a.advantage!r} scores the outcome (the sum of the turn rewards)")
  check(
      a.clip_cov_ratio > 0 and a.kl_cov_ratio > 0,
      f"algorithm.clip_cov_ratio={a.clip_cov_ratio} and kl_cov_ratio={a.kl_cov_ratio} must "
      "be > 0")
  check(a.clip_cov_lb < a.clip_cov_ub,
        f"algorithm.clip_cov_lb={a.clip_cov_lb} must be below clip_cov_ub={a.clip_cov_ub}")
  check(a.ppo_kl_coef >= 0, f"algorithm.ppo_kl_coef={a.ppo_kl_coef} must be >= 0")
  check(a.dual_clip_c == 0 or a.dual_clip_c > 1,
        f"algorithm.dual_clip_c={a.dual_clip_c} must be 0 (off) or > 1")
  check(
      a.dual_clip_c == 0 or rl.get_policy_loss(a.policy_loss).dual_clip,
      f"algorithm.dual_clip_c={a.dual_clip_c} is PPO's; algorithm.policy_loss="
      f"{a.policy_loss!r} has no dual clip")
  check(a.loss_scale_tokens >= 0, f"algorithm.loss_scale_tokens={a.loss_scale_tokens} must be >= 0")
  check(
      a.loss_scale_tokens == 0 or a.aggregation in rl.SCALED_AGGREGATIONS,
      f"algorithm.loss_scale_tokens={a.loss_scale_tokens} is the divisor of "
      f"{', '.join(rl.SCALED_AGGREGATIONS)}; algorithm.aggregation={a.aggregation!r} has none")
  check(
      a.rollout_correction in ("auto",) + rl.CORRECTIONS,
      f"algorithm.rollout_correction={a.rollout_correction!r} is not one of "
      f"{['auto', *rl.CORRECTIONS]}")
  check(
      r.max_staleness == 0 or a.rollout_correction != "none",
      f"rollout.max_staleness={r.max_staleness} trains on episodes of a policy up to "
      f"{r.max_staleness} updates old: set algorithm.rollout_correction to weigh them from the "
      "policy that played them to the one at the update's start (decoupled: decoupled PPO; "
      "token_tis: its truncated form; sequence_mask, geometric_mask)")
  check(a.rollout_correction_cap > 1,
        f"algorithm.rollout_correction_cap={a.rollout_correction_cap} must be > 1")
  for key in ("kl_coef", "kl_in_reward_coef", "entropy_coef", "value_coef",
              "negative_advantage_weight"):
    check(a[key] >= 0, f"algorithm.{key}={a[key]} must be >= 0")
  check(0 <= a.gamma <= 1 and 0 <= a.lam <= 1, "algorithm.gamma and lam must be in [0, 1]")
  check(a.ppo_epochs >= 1, f"algorithm.ppo_epochs={a.ppo_epochs} must be >= 1")
  check(a.num_minibatches >= 1, f"algorithm.num_minibatches={a.num_minibatches} must be >= 1")
  check(
      r.rows % a.num_minibatches == 0,
      f"algorithm.num_minibatches={a.num_minibatches} does not divide the "
      f"{r.rows} trajectories per step")
  minibatch = r.rows // a.num_minibatches
  check(
      a.micro_batch_rows == 0 or (a.micro_batch_rows > 0 and minibatch % a.micro_batch_rows == 0),
      f"algorithm.micro_batch_rows={a.micro_batch_rows} must be 0 (off) or divide the "
      f"minibatch of {minibatch} trajectories")
  if a.shared_prompts:
    check(
        not r.context.rewrites,
        f"algorithm.shared_prompts=True packs a task's episodes as one shared prompt and their "
        f"continuations; rollout.context={r.context.kind!r} plays an episode in several contexts. "
        "Set one of them off")
    check(
        r.tasks_per_step % a.num_minibatches == 0,
        f"algorithm.num_minibatches={a.num_minibatches} does not divide the "
        f"{r.tasks_per_step} tasks per step, which algorithm.shared_prompts=True keeps whole "
        "(or set it False)")
    check(
        a.micro_batch_rows % r.samples_per_task == 0,
        f"algorithm.micro_batch_rows={a.micro_batch_rows} is not a multiple of "
        f"rollout.samples_per_task={r.samples_per_task}: algorithm.shared_prompts=True keeps "
        "tasks whole (or set it False)")
  check(
      not rl.get_advantage_estimator(a.advantage).needs_groups or r.samples_per_task > 1,
      f"algorithm.advantage={a.advantage!r} compares samples of a task: "
      f"rollout.samples_per_task must be > 1")
  token_level = sorted(
      name for name, entry in rl.ADVANTAGE_ESTIMATORS.items() if "token_rewards" in entry.accepts)
  check(
      a.kl_in_reward_coef == 0 or a.advantage in token_level,
      f"algorithm.kl_in_reward_coef={a.kl_in_reward_coef} needs a token-level estimator, one "
      f"of {token_level}; {a.advantage!r} takes one reward per trajectory")
  check(a.logprob_chunk > 0, f"algorithm.logprob_chunk={a.logprob_chunk} must be > 0")


def _check_optim(c: ml_collections.ConfigDict) -> None:
  o = c.optim
  check(o.learning_rate > 0, f"optim.learning_rate={o.learning_rate} must be > 0")
  check(o.schedule in ("constant", "cosine"),
        f"optim.schedule={o.schedule!r} is not 'constant' or 'cosine'")
  check(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
  updates = optimizer_updates(c)
  check(
      o.schedule != "cosine" or o.warmup_steps < updates,
      f"optim.warmup_steps={o.warmup_steps} must be below the run's {updates} optimizer "
      "updates with the cosine schedule")
  check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"optim.b1={o.b1} and optim.b2={o.b2} must be in [0, 1)")
  check(o.eps > 0, f"optim.eps={o.eps} must be > 0")
  check(o.grad_clip > 0, f"optim.grad_clip={o.grad_clip} must be > 0")
  check(o.max_consecutive_nonfinite >= 1, "optim.max_consecutive_nonfinite must be >= 1")
  check(isinstance(o.offload_state, bool),
        f"optim.offload_state={o.offload_state!r} must be True or False")


def optimizer_updates(c: ml_collections.ConfigDict) -> int:
  """The run's optimizer updates: an RL step makes ppo_epochs x num_minibatches, an offline
  step one."""
  a = c.algorithm
  return c.steps * (a.ppo_epochs * a.num_minibatches if c.mode == "rl" else 1)


def _loss(c: ml_collections.ConfigDict, sampling: rollout.TurnSampling,
          max_turns: int) -> learner.LossConfig:
  """The loss of config group algorithm, scoring the rollout's tokens as `sampling` drew them
  (its temperature)."""
  a = c.algorithm
  if c.mode != "rl":
    return learner.LossConfig(logprob_chunk=a.logprob_chunk)
  estimator = rl.get_advantage_estimator(a.advantage)
  options = sorted((argument, a[key]) for argument, key in estimator.hyperparameters)
  policy_loss = rl.get_policy_loss(a.policy_loss)
  # A loss without a clip range (KL-Cov) carries PPO's, which it does not read.
  clip_low, clip_high = policy_loss.clip_keys or ("clip_eps_low", "clip_eps_high")
  policy_options = tuple((key, a[key]) for key in policy_loss.options)
  return learner.LossConfig(
      advantage_estimator=a.advantage, advantage_options=tuple(options),
      negative_advantage_weight=a.negative_advantage_weight, policy_loss=a.policy_loss,
      policy_loss_options=policy_options, clip_eps_low=a[clip_low], clip_eps_high=a[clip_high],
      dual_clip_c=a.dual_clip_c or None, aggregation=a.aggregation,
      loss_scale_tokens=_loss_scale_tokens(a, sampling.max_new_tokens * max_turns),
      rollout_correction=_rollout_correction(c), rollout_correction_cap=a.rollout_correction_cap,
      kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_in_reward_coef=a.kl_in_reward_coef,
      kl_in_reward_estimator=a.kl_in_reward_estimator, entropy_coef=a.entropy_coef,
      value_coef=a.value_coef, value_clip_eps=a.value_clip_eps, temperature=sampling.temperature,
      logprob_chunk=a.logprob_chunk, micro_batch_rows=a.micro_batch_rows)


def _rollout_correction(c: ml_collections.ConfigDict) -> str:
  """algorithm.rollout_correction, "auto" resolved: decoupled PPO's weights for asynchronous
  runs (rollout.max_staleness > 0), none for synchronous ones."""
  if c.algorithm.rollout_correction != "auto":
    return c.algorithm.rollout_correction
  return "decoupled" if c.rollout.max_staleness else "none"


def _loss_scale_tokens(a: ml_collections.ConfigDict, most_tokens: int) -> float | None:
  """A scaled aggregation's divisor: algorithm.loss_scale_tokens (config group `a`), or if 0
  `most_tokens`, the most a trajectory can have trained (max_new_tokens a turn times the
  horizon's largest cap); None for the other aggregations."""
  if a.aggregation not in rl.SCALED_AGGREGATIONS:
    return None
  if a.loss_scale_tokens:
    return float(a.loss_scale_tokens)
  return float(most_tokens)


def _optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW of config group optim over the run's optimizer updates (`optimizer_updates`)."""
  o = c.optim
  if o.schedule == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, max(o.warmup_steps, 1),
                                                  optimizer_updates(c))
  elif o.warmup_steps:
    schedule = optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
  else:
    schedule = optax.constant_schedule(o.learning_rate)
  return learner.make_optimizer(schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                                grad_clip=o.grad_clip,
                                max_consecutive_nonfinite=o.max_consecutive_nonfinite)


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """How a run evaluates: every `every` steps (0: never), the first `max_tasks` tasks (0: all)
  of `split` (of each environment's, in a mixture), `samples_per_task` episodes each, turns
  sampled by `sampling` up to `horizon`; the recipe's stage evaluations (`stages`) play `rows`
  episodes at once (0: a step's rows) and are kept by fingerprint in `cache_dir` ("": not
  kept)."""

  every: int
  split: str
  max_tasks: int
  samples_per_task: int
  sampling: rollout.TurnSampling
  horizon: int
  stages: bool
  rows: int
  cache_dir: str

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict, max_turns: int) -> Evaluation:
    """Config group eval's settings; a turn cap of 0 is the horizon's largest, `max_turns`."""
    e = c.eval
    check(e.every >= 0, f"eval.every={e.every} must be >= 0")
    check(e.split in env_base.SPLITS, f"eval.split={e.split!r} is not one of {env_base.SPLITS}")
    check(e.samples_per_task >= 1, "eval.samples_per_task must be >= 1")
    check(e.max_tasks >= 0, f"eval.max_tasks={e.max_tasks} must be >= 0")
    check(e.temperature >= 0, f"eval.temperature={e.temperature} must be >= 0")
    check(e.horizon >= 0, f"eval.horizon={e.horizon} must be >= 0")
    check(e.rows >= 0, f"eval.rows={e.rows} must be >= 0")
    check(
        not e.cache_dir or "://" in e.cache_dir
        or not os.path.isfile(os.path.expanduser(e.cache_dir)),
        f"eval.cache_dir={e.cache_dir!r} is a file, not a directory (\"\" turns the cache off)")
    check(
        not e.stages
        or (c.mode == "rl" and c.checkpoint.export_hf and c.checkpoint.export_format == "merged"),
        "eval.stages evaluates the stages of an RL run's recipe from their exports: it needs "
        "mode='rl', checkpoint.export_hf=True and checkpoint.export_format='merged'")
    return cls(every=e.every, split=e.split, max_tasks=e.max_tasks,
               samples_per_task=e.samples_per_task, sampling=_turn_sampling(c, e.temperature),
               horizon=e.horizon or max_turns, stages=e.stages, rows=e.rows, cache_dir=e.cache_dir)

  def after(self, step: int) -> bool:
    """Whether the run evaluates after `step` steps: every `every` (never with 0)."""
    return bool(self.every) and step % self.every == 0

  def tasks(self, pool: EnvPool | MixturePool) -> list[int]:
    """The tasks of eval.split: the first max_tasks (0: all) of each environment's."""
    task_ids = list(pool.task_ids(self.split))
    if not self.max_tasks:
      return task_ids
    environments = itertools.groupby(task_ids, lambda t: pool.environment(t).name)
    return [t for _, tasks in environments for t in itertools.islice(tasks, self.max_tasks)]


@dataclasses.dataclass(frozen=True)
class Data:
  """An offline run's conversations (config groups data and dpo): the file or run at `path`,
  the records with a reward of at least `min_reward`, `batch_size` conversations (pairs, for
  DPO) a step, each at most `max_length` tokens; DPO's inverse temperature `dpo_beta`."""

  path: str
  min_reward: float
  batch_size: int
  max_length: int
  dpo_beta: float

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> Data:
    d = c.data
    if c.mode != "rl":
      check(bool(d.path), f"mode={c.mode!r} needs data.path (conversations JSONL or a run)")
      check(d.batch_size > 0 and d.max_length > 0,
            "data.batch_size and data.max_length must be > 0")
      check(c.dpo.beta > 0, f"dpo.beta={c.dpo.beta} must be > 0")
    return cls(path=d.path, min_reward=d.min_reward, batch_size=d.batch_size,
               max_length=d.max_length, dpo_beta=c.dpo.beta)


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

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> CheckpointSettings:
    k = c.checkpoint
    check(k.export_dtype in DTYPES,
          f"checkpoint.export_dtype={k.export_dtype!r} is not one of {DTYPES}")
    check(k.export_format in EXPORT_FORMATS,
          f"checkpoint.export_format={k.export_format!r} is not one of {EXPORT_FORMATS}")
    check(k.export_format != "peft" or c.model.lora.rank > 0,
          "checkpoint.export_format='peft' writes LoRA adapters: it needs model.lora.rank > 0")
    check(k.every >= 0 and k.keep >= 1, "checkpoint.every must be >= 0 and checkpoint.keep >= 1")
    return _group(cls, k)

  def checkpointer(self, workdir: pathlib.Path, steps: int) -> checkpoint.Checkpointer:
    """workdir/checkpoints, saved every checkpoint.every steps (or only at the last of the
    run's `steps`), keeping the newest checkpoint.keep."""
    return checkpoint.Checkpointer(workdir / "checkpoints", keep=self.keep, save_every=self.every
                                   or steps)


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

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> LogSettings:
    check(not c.log.wandb or importlib.util.find_spec("wandb") is not None,
          "log.wandb=True needs wandb: pip install -e \".[wandb]\"")
    return _group(cls, c.log)


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """An RL run's SFT warm start (config group warm_start): `steps` SFT steps (0: none) on the
  demonstrations in `demonstrations`, or on the environment expert's of up to `max_tasks`
  train tasks (0: all) when that is ""; `batch_size` demonstrations a step at a constant
  `learning_rate`."""

  steps: int
  demonstrations: str
  max_tasks: int
  learning_rate: float
  batch_size: int

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> WarmStart:
    w = c.warm_start
    check(w.steps >= 0 and w.max_tasks >= 0, "warm_start.steps and max_tasks must be >= 0")
    if w.steps:
      from agentgym_jax import demonstrations  # pylint: disable=import-outside-toplevel
      check(c.mode == "rl", f"warm_start is a stage of an RL run, not of mode={c.mode!r}")
      check(
          bool(w.demonstrations) or c.env.name in demonstrations.EXPERTS,
          f"warm_start.demonstrations must name a JSONL of conversations: env {c.env.name!r} "
          f"has no expert (experts: {sorted(demonstrations.EXPERTS)})")
      check(w.learning_rate > 0 and w.batch_size > 0,
            "warm_start.learning_rate and batch_size must be > 0")
    return _group(cls, w)


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
  """Model-judged rewards (config group reward.judge; agentgym_jax/judge.py): `mode`, the
  judge (`model` run by the sampler, or an OpenAI-compatible server at `base_url` serving
  `served_model`), the `rubric`, and the judge's budgets."""

  mode: str
  model: str
  base_url: str
  served_model: str
  api_key_env: str
  rubric: str
  max_new_tokens: int
  max_context: int
  rows: int
  timeout_s: float
  episode_chars: int

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> JudgeSettings | None:
    """None when reward.judge.mode is "" (no judge)."""
    j = c.reward.judge
    if not j.mode:
      return None
    check(j.mode in judge_lib.MODES,
          f"reward.judge.mode={j.mode!r} is not '' (off) or one of {judge_lib.MODES}")
    check(
        bool(j.model) != bool(j.base_url),
        "reward.judge needs exactly one of model (run by the sampler) and base_url (an "
        f"OpenAI-compatible server), got model={j.model!r} and base_url={j.base_url!r}")
    check(not j.base_url or j.base_url.startswith(("http://", "https://")),
          f"reward.judge.base_url={j.base_url!r} must start with http:// or https://")
    check(not j.base_url or bool(j.served_model),
          "reward.judge.base_url needs reward.judge.served_model, the model its requests name")
    check(j.mode == "reference" or bool(j.rubric.strip()),
          f"reward.judge.mode={j.mode!r} needs reward.judge.rubric, what a good episode is")
    check(
        0 < j.max_new_tokens < j.max_context,
        f"need 0 < reward.judge.max_new_tokens ({j.max_new_tokens}) < max_context "
        f"({j.max_context})")
    check(j.rows > 0 and j.timeout_s > 0 and j.episode_chars >= 200,
          "reward.judge.rows and timeout_s must be > 0, episode_chars >= 200")
    return _group(cls, j)

  def make(self, dtype: str, cache: pathlib.Path | None = None) -> judge_lib.Judge:
    """The judge: its model loaded (matmul `dtype`, bf16 weights) or its server named, its replies cached in
    the JSONL file `cache` (memory only without one)."""
    if self.base_url:
      backend = judge_lib.HTTPBackend(self.base_url, self.served_model,
                                      max_new_tokens=self.max_new_tokens, timeout_s=self.timeout_s,
                                      concurrency=self.rows, api_key_env=self.api_key_env)
    else:
      backend = judge_lib.SamplerBackend.load(self.model, dtype=dtype, rows=self.rows,
                                              max_context=self.max_context,
                                              max_new_tokens=self.max_new_tokens)
    return judge_lib.Judge(backend, self.mode, rubric=self.rubric,
                           max_new_tokens=self.max_new_tokens, episode_chars=self.episode_chars,
                           cache=judge_lib.ReplyCache(cache))


@dataclasses.dataclass(frozen=True)
class Health:
  """When a run stops as broken (`check`): after `max_consecutive_nonfinite` non-finite updates
  in a row (optim.max_consecutive_nonfinite), or when the sampler's and the learner's
  log-probs differ by more than `max_logprob_gap` nats a token (rollout.max_logprob_gap) on a
  step played by the policy it trains. A stale step (rollout/staleness > 0, asynchronous RL) is
  not held to it: its gap holds the updates made since it was played, which the rollout
  correction weighs, and grows with the learning rate, not with a defect."""

  max_consecutive_nonfinite: int
  max_logprob_gap: float

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> Health:
    gap = c.rollout.max_logprob_gap
    check(gap > 0, f"rollout.max_logprob_gap={gap} must be > 0")
    return cls(max_consecutive_nonfinite=c.optim.max_consecutive_nonfinite, max_logprob_gap=gap)

  def check(self, fetched: Mapping[str, Any]) -> None:
    """Stops the run with a clear message when a step's metrics `fetched` say it is broken."""
    if fetched.get("nonfinite_steps", 0) >= self.max_consecutive_nonfinite:
      raise FloatingPointError(
          f"{int(fetched['nonfinite_steps'])} consecutive updates had non-finite gradients; "
          f"stopping (optim.max_consecutive_nonfinite={self.max_consecutive_nonfinite})")
    gap = fetched.get("logprob_gap_mean")
    if gap is not None and gap > self.max_logprob_gap and not fetched.get("rollout/staleness"):
      raise RuntimeError(
          f"the sampler's and the learner's log-probs differ by {gap:.3g} nats per token on "
          f"average (> rollout.max_logprob_gap={self.max_logprob_gap}): the sampled tokens are "
          "no longer on-policy")


def _group(cls: type[Any], group: ml_collections.ConfigDict) -> Any:
  """A settings dataclass whose fields are keys of the config `group`, read from it."""
  return cls(**{field.name: group[field.name] for field in dataclasses.fields(cls)})


# --- the run's settings ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a run derives from its config, built and validated once (`from_config`) and handed
  to the loops, which read nothing else.

  Attributes:
    record: the validated config as plain data, recorded in checkpoints' meta and wandb.
    mode, seed, steps: the run's kind (rl | sft | dpo), its seed and its number of steps.
    schedule: the ScalingInter-RL horizon schedule (the turn cap of every step).
    model, env, rollout, update, evaluation, data, checkpoint, log, warm_start, health: the
      groups (`ModelSettings`, `EnvSettings`, `RolloutSettings`, `UpdateSettings`,
      `Evaluation`, `Data`, `CheckpointSettings`, `LogSettings`, `WarmStart`, `Health`).
    judge: the model-judged rewards (`JudgeSettings`), None without a judge.
  """

  record: dict[str, Any]
  mode: str
  seed: int
  steps: int
  schedule: horizon.HorizonSchedule
  model: ModelSettings
  env: EnvSettings
  rollout: RolloutSettings
  update: UpdateSettings
  evaluation: Evaluation
  data: Data
  checkpoint: CheckpointSettings
  log: LogSettings
  warm_start: WarmStart
  health: Health
  judge: JudgeSettings | None = None

  @classmethod
  def of(cls, c: ml_collections.ConfigDict | Settings) -> Settings:
    """`c` itself if it is settings already, else its settings (`from_config`): a loop called
    with a config validates it here, one called with settings (the recipe's stages, the
    command) takes them as they are."""
    return c if isinstance(c, Settings) else cls.from_config(c)

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> Settings:
    """The settings of config `c`, every value checked by the group that reads it; raises
    ConfigError with one line naming the key."""
    check(c.mode in ("rl", "sft", "dpo"), f"mode={c.mode!r} is not 'rl', 'sft' or 'dpo'")
    check(c.steps > 0, f"steps={c.steps} must be > 0")
    model, env = ModelSettings.from_config(c), EnvSettings.from_config(c)
    rollout_settings = RolloutSettings.from_config(c)
    schedule = horizon_schedule(c)
    update = UpdateSettings.from_config(c, rollout_settings, schedule.max_turns,
                                        env.failed_episodes)
    return cls(record=c.to_dict(), mode=c.mode, seed=c.seed, steps=c.steps, schedule=schedule,
               model=model, env=env, rollout=rollout_settings, update=update,
               evaluation=Evaluation.from_config(c, schedule.max_turns), data=Data.from_config(c),
               checkpoint=CheckpointSettings.from_config(c), log=LogSettings.from_config(c),
               warm_start=WarmStart.from_config(c), health=Health.from_config(c),
               judge=JudgeSettings.from_config(c))

  def make_judge(self, cache: pathlib.Path | None = None) -> judge_lib.Judge | None:
    """The run's judge (reward.judge), its replies cached in the JSONL file `cache`; None
    without one."""
    return self.judge and self.judge.make(self.model.matmul_dtype(), cache)

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
    w = self.warm_start
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
    r, update = self.rollout, self.update
    process_rows = r.rows // process_count
    check(
        self.model.rollout_mesh[0] == 0 or process_count == 1,
        f"mesh.rollout_devices={self.model.rollout_mesh[0]} splits one process's devices; this "
        f"run has {process_count} processes")
    check(
        r.max_staleness == 0 or process_count == 1,
        f"rollout.max_staleness={r.max_staleness} plays ahead in a thread of its own, on one "
        f"process; this run has {process_count}")
    check(
        process_rows % r.pipeline_groups == 0,
        f"rollout.pipeline_groups={r.pipeline_groups} does not divide the {process_rows} "
        f"trajectories of each of the {process_count} processes")
    check(
        r.wave(process_rows) % r.pipeline_groups == 0,
        f"rollout.pipeline_groups={r.pipeline_groups} does not divide a wave of "
        f"{r.wave(process_rows)} of each process's {process_rows} trajectories")
    batch_shards = sharding.batch_shards(mesh)
    minibatch = r.rows // update.num_minibatches
    check(
        minibatch % batch_shards == 0,
        f"a minibatch of {minibatch} trajectories (tasks_per_step x samples_per_task / "
        f"num_minibatches) does not split over the {batch_shards} devices of the mesh's data x "
        "fsdp axes; change the batch or mesh.data/mesh.fsdp")
    micro = update.loss.micro_batch_rows
    check(
        not micro or micro % batch_shards == 0,
        f"algorithm.micro_batch_rows={micro} does not split over the {batch_shards} devices of "
        "the mesh's data x fsdp axes")
    # Packed rows are padded with empty ones to split over the devices, but micro-batches take
    # every count-th packed row (learner.split_micro_batches), which padding would unbalance.
    check(
        not (update.shared_prompts and micro and (micro // r.samples_per_task) % batch_shards),
        f"the {micro // r.samples_per_task} tasks of a micro-batch (algorithm.micro_batch_rows "
        f"/ rollout.samples_per_task) do not split over the {batch_shards} devices of the "
        "mesh's data x fsdp axes; change them or set algorithm.shared_prompts=False")

  def meta(self, step: int, **extra: Any) -> dict[str, Any]:
    """A checkpoint's meta: the step, `extra`, the seed and the config."""
    return {"step": step, **extra, "seed": self.seed, "config": copy.deepcopy(self.record)}
