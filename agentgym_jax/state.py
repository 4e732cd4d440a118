"""What a training loop holds: the policy (loaded, split into trained and frozen parameters,
exported), the run state a checkpoint restores and its resume, LoRA's dropout keys, and the
timing of a step's phases.

The RL loop (trainer.py) and the offline loop (offline.py) sit side by side on top of this
module and of settings.py; neither imports the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import checkpoint, hardware, learner, memory, multihost, paths, rl, sharding
from agentgym_jax.batch import packed_length
from agentgym_jax.config import ConfigError
from agentgym_jax.models import Decoder, attention, decoder, load_model, lora as lora_lib, weights
from agentgym_jax.models.tokenizer import Tokenizer
from agentgym_jax.settings import Settings

# --- the policy ----------------------------------------------------------------------------


def load_policy(settings: Settings, model_name: str | None = None, *,
                training: bool = False) -> tuple[Mesh, Decoder, Tokenizer]:
  """(mesh, model, tokenizer): the policy (model.name, or `model_name`) loaded sharded on the
  configured mesh. model.remat=auto is resolved for the run's update step when `training` (see
  `auto_remat`), and is none otherwise (sampling has no backward pass)."""
  m = settings.model
  sharding.initialize_distributed()
  mesh = m.make_mesh()
  dtype = m.matmul_dtype()
  if m.dtype == "auto":
    logging.info("model.dtype=auto: %s, as %s", dtype, hardware.auto_dtype()[1])
  implementation = attention.choose(m.attention)
  if implementation == "splash" and jax.default_backend() != "tpu":
    raise ConfigError(f"invalid config: model.attention=splash runs a TPU kernel; the backend is "
                      f"{jax.default_backend()} (use auto, flash or dense)")
  logging.info("model.attention=%s: %s attention on %s", m.attention, implementation,
               jax.default_backend())
  model, tokenizer = load_model(model_name or m.name, dtype=jnp.dtype(dtype),
                                param_dtype=jnp.dtype(m.param_dtype),
                                remat="none" if m.remat == "auto" else m.remat,
                                attention=m.attention, mesh=mesh)
  if m.remat == "auto" and training:
    model.remat, why = auto_remat(settings, model, mesh)
    logging.info("model.remat=auto: %s, as %s", model.remat, why)
  return mesh, model, tokenizer


def update_shape(settings: Settings) -> tuple[int, int]:
  """(rows, tokens) of the run's largest update step: an RL minibatch of rollout rows packed to
  packed_length(max_context), or an offline batch of data.max_length rows (twice the rows for
  DPO, which scores both sides of each pair)."""
  if settings.mode == "rl":
    r = settings.rollout
    return r.rows // settings.update.num_minibatches, packed_length(r.max_context)
  data = settings.data
  return data.batch_size * (2 if settings.mode == "dpo" else 1), data.max_length


def auto_remat(settings: Settings, model: Decoder, mesh: Mesh) -> tuple[str, str]:
  """(policy, why) for model.remat=auto: the memory planner's `choose_remat` over the backend's
  policies (`memory.remat_preference`) on the update step of `update_shape`, beside what stays
  resident through it (the reference policy; an RL step's whole batch and experience). A
  device's memory is the smallest any process reports, so every process picks the same
  policy."""
  rows, tokens = update_shape(settings)
  lora, loss = settings.model.lora, settings.update.loss
  param_dtype = jnp.dtype(settings.model.param_dtype)
  _, params = memory.abstract_params(model.config, mesh, dtype=model.dtype, param_dtype=param_dtype)
  resident = 0
  # The reference (Policy.reference): of the whole model, or of LoRA's adapters, left out here
  # as small beside the step.
  if (loss.uses_reference or settings.mode == "dpo") and lora is None:
    resident += memory.reference_bytes(params, model.dtype)
  if settings.mode == "rl":
    resident += memory.device_bytes(memory.abstract_minibatch(mesh, settings.rollout.rows, tokens))
  device_bytes, source = hardware.device_memory()
  if jax.process_count() > 1:
    device_bytes = min(multihost.all_gather_objects(device_bytes))
    source += ", the smallest of the processes'"
  step = memory.StepShape(rows, tokens, dtype=model.dtype, param_dtype=param_dtype,
                          attention=model.attention, logits_chunk=loss.logprob_chunk,
                          micro_batch_rows=loss.micro_batch_rows, lora=lora)
  peak = lambda remat: memory.plan(model.config, mesh, dataclasses.replace(step, remat=remat)
                                  ).peak_bytes
  remat, why = memory.choose_remat(peak, device_bytes, resident,
                                   memory.remat_preference(jax.default_backend()))
  return remat, f"a {rows} x {tokens} update step: {why} ({source})"


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

  @classmethod
  def of(cls, settings: Settings, model: Decoder, mesh: Mesh | None) -> Policy:
    """The loaded `model` split into what the run trains and what stays frozen: with LoRA,
    fresh adapters from the run's seed over the frozen model."""
    graphdef, params = nnx.split(model)
    lora, export_format = settings.model.lora, settings.checkpoint.export_format
    if lora is None:
      return cls(graphdef, params, None, graphdef, None, export_format)
    adapters = lora_lib.init_adapters(model.config, lora, settings.seed, mesh)
    lora_graphdef, adapter_params, base = lora_lib.split(lora_lib.LoraModel(model, adapters))
    merge = jax.jit(functools.partial(lora_lib.merged_params, lora_graphdef),
                    out_shardings=jax.tree.map(lambda x: x.sharding, params))
    return cls(lora_graphdef, adapter_params, base, graphdef, merge, export_format)

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


def export_policy(settings: Settings, model: Decoder | lora_lib.Adapters, tokenizer: Tokenizer,
                  workdir: pathlib.Path) -> None:
  """The trained policy (`Policy.exported`) in workdir/export, in checkpoint.export_dtype: a
  decoder as a Hugging Face directory, LoRA's adapters as a PEFT adapter directory (over
  model.name); the tokenizer beside either."""
  if paths.is_remote(workdir):
    with tempfile.TemporaryDirectory() as local:  # Written locally, then copied file by file.
      export_policy(settings, model, tokenizer, pathlib.Path(local))
      paths.copy_tree(local, workdir / "export")
    return
  dtype = settings.checkpoint.export_dtype
  if isinstance(model, lora_lib.Adapters):
    lora_lib.save_peft(model, workdir / "export", settings.model.name, dtype=dtype)
  else:
    weights.save_hf(model, workdir / "export", dtype=dtype)
  tokenizer.save_pretrained(workdir / "export")


# fold_in of the seed's key that the updates' keys derive from: apart from the steps' rollout
# keys (fold_in(seed key, step)) and the evaluation's (1 << 30).
UPDATE_STREAM = 1 << 29


def update_key(settings: Settings, step: int, update: int) -> jax.Array | None:
  """The key of optimizer update `update` of step `step`, which LoRA's dropout and a drawing
  policy loss (Clip-Cov) draw from: a pure function of the seed, so a resumed run draws what an
  uninterrupted one draws. None when nothing draws."""
  lora = settings.model.lora
  dropout = lora is not None and lora.dropout
  if not dropout and not rl.get_policy_loss(settings.update.loss.policy_loss).draws:
    return None
  stream = jax.random.fold_in(jax.random.key(settings.seed), UPDATE_STREAM)
  return jax.random.fold_in(jax.random.fold_in(stream, step), update)


# --- the run state -------------------------------------------------------------------------


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
