"""Per-device memory of a policy's RL update step and sampler on a mesh, from abstract arrays.

No weights are read and no device memory is allocated: parameters, optimizer state and the batch
are `jax.ShapeDtypeStruct`s carrying their `NamedSharding`s, so a 7B plan for an 8-chip mesh runs
on a workstation (the mesh is made of virtual CPU devices).

    agentgym-plan --model=qwen2.5-7b-instruct --mesh=1,8,1 --mesh=1,4,2 \
        --batch=8 --seq=4096

Per device, for one update step: the learner's own `update_step` (GRPO's clipped policy loss on
chunked log-probs, forward + backward, AdamW after clipping) on a [batch, seq] minibatch:

  params      sum over parameters of its shard's bytes under sharding.LOGICAL_AXIS_RULES
  optimizer   AdamW's two moments, sharded like the parameters: mu in f32, nu in the parameters'
              dtype (as optax keeps it; both f32 with the default f32 parameters)
  temp        XLA's scratch buffer of the compiled step (`memory_analysis().temp_size`): the
              activations the backward keeps under the remat policy, the gradients, one chunk of
              logits at a time, and the fusions' working space
  peak        arguments + outputs that do not reuse a donated argument + temp
  reference   a KL loss's (or DPO's) frozen reference, resident beside the step: the
              parameters with their matmul weights in the matmul dtype (state.Policy.reference);
              + ref = peak + reference

With LoRA (`--lora_rank=r`, `--lora_targets`) the step trains adapters over the frozen
parameters (agentgym_jax/models/lora.py): params are then the frozen base, adapters the
trained A and B, and optimizer AdamW's moments of the adapters only.

    agentgym-plan --mesh=1,8,1 --batch=8 --seq=4096 --lora_rank=64

params, adapters and optimizer are exact: they follow from the shardings alone. temp is the XLA:CPU
compiler's schedule of the same SPMD program; a TPU's differs (other fusions and layouts, and
`--attention=auto` is the Pallas splash kernel there, flash attention here), so read it as an
estimate. `choose_remat` reads the same estimate to resolve model.remat=auto. The compiled
step's argument bytes are checked against params + optimizer + batch, which catches a sharding
the compiler did not honour.

The sampler (`--sampler_mesh`) is planned the same way: the two programs `Sampler` compiles,
prefill (appending `--prefill` tokens to every row, attending to `--prefill_window` cache slots,
by default all) and decode (`--max_new_tokens` per row, reading the slots the rows hold) on a
[rows, cache_slots] KV cache:

  agentgym-plan --sampler_mesh=1,4,1 --rows=64 --cache_slots=10240

  cache       the KV cache's shard, exact: layers x rows x kv heads x slots x head_dim x 2 (keys
              and values) in the model's matmul dtype
  peak        params + cache + the larger of the two programs' scratch and fresh outputs

`--devices=N` builds N virtual CPU devices (default: as many as the largest mesh needs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentgym_jax import learner, sampling, sharding
from agentgym_jax.batch import Batch
from agentgym_jax.models import decoder, lora as lora_lib, weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import KVCache

# Hugging Face config.json fields of models planned without their checkpoint on disk.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b-instruct": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


def model_config(model: str) -> ModelConfig:
  """The config of a name in HF_CONFIGS, or of a checkpoint directory or config.json path."""
  if model in HF_CONFIGS:
    return ModelConfig.from_hf(HF_CONFIGS[model])
  path = pathlib.Path(model).expanduser()
  if path.is_dir():
    path = path / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{model!r} is neither a planned model ({', '.join(HF_CONFIGS)}) "
                            f"nor a checkpoint directory or config.json")
  return ModelConfig.from_json(path)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device bytes of one update step; the step fields are None when it was not compiled."""

  mesh_shape: tuple[int, int, int]  # (data, fsdp, tensor)
  batch: int
  seq: int
  num_params: int
  param_bytes: int
  optimizer_bytes: int
  batch_bytes: int
  adapter_bytes: int = 0  # LoRA's trained adapters (the optimizer's moments are of these).
  reference_bytes: int = 0  # A KL loss's or DPO's frozen reference (state.Policy.reference).
  temp_bytes: int | None = None
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  compile_seconds: float | None = None

  @property
  def peak_bytes(self) -> int | None:
    if self.temp_bytes is None:
      return None
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (or arrays)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard_shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def abstract_matmul_copy(params: nnx.State, dtype: Any) -> nnx.State:
  """`decoder.matmul_copy` of abstract `params`, on their shardings."""
  copy = jax.eval_shape(lambda params: decoder.matmul_copy(params, dtype), params)
  return jax.tree.map(lambda x, c: jax.ShapeDtypeStruct(x.shape, c.dtype, sharding=x.sharding),
                      params, copy)


def reference_bytes(trained: nnx.State, dtype: Any, lora: bool = False) -> int:
  """Bytes one device holds of the frozen reference (state.Policy.reference) of the `trained`
  parameters: LoRA's adapters as they are, a model's with its matmul weights in `dtype`."""
  return device_bytes(trained if lora else abstract_matmul_copy(trained, dtype))


def abstract_params(config: ModelConfig, mesh: Mesh, *, dtype: Any = jnp.bfloat16,
                    param_dtype: Any = jnp.float32, remat: str = "full",
                    attention: str = "auto") -> tuple[nnx.GraphDef, nnx.State]:
  """The model's graph and its parameters as ShapeDtypeStructs with their NamedShardings."""
  model = weights.abstract_model(config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                 attention=attention)
  graphdef, params = nnx.split(model)
  return graphdef, _place(params, mesh)


def abstract_lora(config: ModelConfig, mesh: Mesh, settings: lora_lib.LoraSettings, *,
                  dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32, remat: str = "full",
                  attention: str = "auto") -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, adapters, base) of a lora.LoraModel as ShapeDtypeStructs with their
  NamedShardings (lora.split's parts)."""
  model = nnx.eval_shape(lambda: lora_lib.LoraModel(
      weights.abstract_model(config, dtype=dtype, param_dtype=param_dtype,
                             remat=remat, attention=attention),
      lora_lib.Adapters(config, settings, nnx.Rngs(0))))
  graphdef, adapters, base = lora_lib.split(model)
  return graphdef, _place(adapters, mesh), _place(base, mesh)


def _place(state: nnx.State, mesh: Mesh) -> nnx.State:
  """Every variable of `state` a ShapeDtypeStruct with its logical axes' NamedSharding."""

  def place(variable: nnx.Variable) -> nnx.Variable:
    shape, dtype = variable.get_value().shape, variable.get_value().dtype
    return variable.replace(
        jax.ShapeDtypeStruct(shape, dtype,
                             sharding=sharding.named_sharding(mesh, variable.axes, shape)))

  return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_optimizer_state(optimizer: optax.GradientTransformation, trainable: Any,
                             mesh: Mesh) -> Any:
  """The optimizer state as ShapeDtypeStructs, laid out as the loops lay it out
  (sharding.train_state_shardings: moments like their arrays, counters replicated)."""
  state = jax.eval_shape(optimizer.init, trainable)
  _, shardings = sharding.train_state_shardings(trainable, state, mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      shardings)


def abstract_batch(mesh: Mesh, batch: int, seq: int) -> jax.ShapeDtypeStruct:
  """Token ids [batch, seq], split over data x fsdp like every batch."""
  return _rows(mesh, (batch, seq), jnp.int32)


def abstract_minibatch(mesh: Mesh, batch: int, seq: int) -> tuple[Batch, learner.Experience]:
  """One update's inputs: a rollout Batch of [batch, seq] rows and its Experience."""
  rows = functools.partial(_rows, mesh)
  return (Batch(tokens=rows((batch, seq), jnp.int32), loss_mask=rows((batch, seq), jnp.float32),
                sampler_logprobs=rows((batch, seq), jnp.float32), rewards=rows(
                    (batch,), jnp.float32), group_ids=rows((batch,), jnp.int32)),
          learner.Experience(*(rows((batch, seq - 1), jnp.float32) for _ in range(6)), kept=rows(
              (batch,), jnp.float32)))


def _rows(mesh: Mesh, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
  """An array of rows, split over data x fsdp like every batch."""
  spec = sharding.logical_to_spec(("batch", "seq")[:len(shape)], shape, mesh)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def lower_forward(config: ModelConfig, mesh: Mesh, batch: int, seq: int, *,
                  dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32) -> jax.stages.Lowered:
  """The jitted forward pass (ids -> logits) lowered on abstract sharded inputs."""
  graphdef, params = abstract_params(config, mesh, dtype=dtype, param_dtype=param_dtype)

  def forward(params, input_ids):
    return nnx.merge(graphdef, params)(input_ids)

  with jax.set_mesh(mesh):
    return jax.jit(forward).lower(params, abstract_batch(mesh, batch, seq))


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What an update step's memory depends on besides the model and the mesh: its minibatch of
  `batch` rows of `seq` tokens, the numerics, the memory options, and with `lora` LoRA's
  adapters over the frozen parameters."""

  batch: int
  seq: int
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  remat: str = "full"
  attention: str = "auto"
  logits_chunk: int = 1024
  micro_batch_rows: int = 0
  lora: lora_lib.LoraSettings | None = None


def lower_train_step(config: ModelConfig, mesh: Mesh, step: StepShape) -> jax.stages.Lowered:
  """The learner's `update_step` on one minibatch, lowered on abstract sharded inputs, jitted
  as the RL trainer jits it (learner.jit_update_step): parameters and optimizer state donated,
  returned with their own shardings. Its log-probs come from chunked logits, so [batch, seq,
  vocab] never exists at once. With micro_batch_rows the step accumulates its gradient over
  micro-batches of that many rows (learner.py). With `lora` the step trains the adapters over
  the frozen parameters."""
  model = dict(dtype=step.dtype, param_dtype=step.param_dtype, remat=step.remat,
               attention=step.attention)
  if step.lora is None:
    graphdef, params = abstract_params(config, mesh, **model)
    frozen = None
  else:
    graphdef, params, frozen = abstract_lora(config, mesh, step.lora, **model)
  optimizer = learner.make_optimizer(1e-6)
  trainable = (params, None)
  state = learner.UpdateState(trainable, abstract_optimizer_state(optimizer, trainable, mesh))
  loss = learner.LossConfig(logprob_chunk=min(step.logits_chunk, step.seq - 1),
                            micro_batch_rows=step.micro_batch_rows)
  update = learner.jit_update_step(jax.tree.map(lambda x: x.sharding, state))
  with jax.set_mesh(mesh):
    return update.lower(learner.Networks(graphdef, frozen=frozen), state,
                        *abstract_minibatch(mesh, step.batch, step.seq), optimizer=optimizer,
                        loss=loss)


def plan(config: ModelConfig, mesh: Mesh, step: StepShape, *, compile: bool = True) -> MemoryPlan:
  """Per-device memory of one update step (with step.lora, of LoRA's update over the frozen
  parameters); compiles the step unless `compile` is False."""
  model = dict(dtype=step.dtype, param_dtype=step.param_dtype, remat=step.remat)
  if step.lora is None:
    _, params = abstract_params(config, mesh, **model)
    trained = params
  else:
    _, trained, params = abstract_lora(config, mesh, step.lora, **model)
  opt_state = abstract_optimizer_state(learner.make_optimizer(1e-6), (trained, None), mesh)
  figures = dict(mesh_shape=tuple(mesh.shape[a] for a in sharding.MESH_AXES), batch=step.batch,
                 seq=step.seq, num_params=config.num_params, param_bytes=device_bytes(params),
                 adapter_bytes=0 if step.lora is None else device_bytes(trained),
                 reference_bytes=reference_bytes(trained, step.dtype, step.lora is not None),
                 optimizer_bytes=device_bytes(opt_state),
                 batch_bytes=device_bytes(abstract_minibatch(mesh, step.batch, step.seq)))
  if compile:
    start = time.perf_counter()
    compiled = lower_train_step(config, mesh, step).compile()
    figures["compile_seconds"] = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is not None:
      figures.update(temp_bytes=stats.temp_size_in_bytes,
                     argument_bytes=stats.argument_size_in_bytes,
                     output_bytes=stats.output_size_in_bytes, alias_bytes=stats.alias_size_in_bytes)
  return MemoryPlan(**figures)


# The policies model.remat=auto tries on a backend, fastest first (others: ACCELERATOR_REMAT).
# On an accelerator each policy recomputes more of the forward pass in the backward than the one
# before it, so the least recomputation that fits is the fastest. On XLA:CPU full
# rematerialisation is the fastest as well as the smallest: keeping the scan's saved residuals
# costs more there than recomputing them (benchmarks/train_step.py --remat=none,dots,full, bf16,
# SmolLM2-135M on a quiet 2-core Intel Xeon with AMX: 4 x 256 tokens 10.3, 7.4 and 6.8 s a
# step; 4 x 1024 tokens 39.4, 34.3 and 31.6 s).
ACCELERATOR_REMAT = ("none", "dots", "full")
REMAT_PREFERENCE = {"cpu": ("full",)}
# The share of a device's memory a step may plan to use: the estimate is XLA's schedule of the
# step alone (and XLA:CPU's when planning for another backend).
MEMORY_HEADROOM = 0.9


def remat_preference(backend: str) -> tuple[str, ...]:
  """The policies model.remat=auto tries on `backend`, fastest first."""
  return REMAT_PREFERENCE.get(backend, ACCELERATOR_REMAT)


def choose_remat(peak_bytes: Callable[[str],
                                      int | None], device_bytes: int, resident_bytes: int = 0,
                 preference: Sequence[str] = ACCELERATOR_REMAT) -> tuple[str, str]:
  """(remat, why): the first policy of `preference` (fastest first) whose update step fits in
  MEMORY_HEADROOM of `device_bytes` per device, next to `resident_bytes` that live beside it
  (a reference model, a whole rollout batch); full when none fits.

  `peak_bytes(remat)` is the step's peak per device under that policy, e.g. `plan(config,
  mesh, dataclasses.replace(step, remat=remat)).peak_bytes` (None: the compiler gives no memory analysis).
  """
  budget = MEMORY_HEADROOM * device_bytes
  gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
  within = f"{MEMORY_HEADROOM:.0%} of {gib(device_bytes)}"
  needs = []
  for remat in preference:
    peak = peak_bytes(remat)
    if peak is None:
      return "full", "the compiler gives no memory analysis to choose by"
    needs.append(f"{remat} needs {gib(peak + resident_bytes)}")
    if peak + resident_bytes <= budget:
      return remat, f"{', '.join(needs)} per device, within {within}"
  return "full", f"none fits: {', '.join(needs)} per device, over {within}"


@dataclasses.dataclass(frozen=True)
class SamplerPlan:
  """Per-device bytes of the sampler; the program fields are None when it was not compiled."""

  mesh_shape: tuple[int, int, int]
  rows: int
  cache_slots: int
  param_bytes: int
  cache_bytes: int
  prefill_bytes: int | None = None  # Scratch plus fresh outputs of one prefill call.
  decode_bytes: int | None = None  # Scratch plus fresh outputs of one decode call.
  compile_seconds: float | None = None

  @property
  def peak_bytes(self) -> int | None:
    if self.prefill_bytes is None:
      return None
    return self.param_bytes + self.cache_bytes + max(self.prefill_bytes, self.decode_bytes)


def abstract_sampler_state(config: ModelConfig, mesh: Mesh, rows: int, cache_slots: int,
                           cache_dtype: Any) -> sampling.SamplerState:
  """A sampler's state (KV cache and last hidden states) as sharded ShapeDtypeStructs."""
  state = jax.eval_shape(lambda: sampling.SamplerState(
      cache=KVCache.zeros(config, rows, cache_slots, cache_dtype), hidden=jnp.zeros(
          (rows, config.hidden_size), jnp.float32)))
  place = lambda x, axes: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding.named_sharding(mesh, axes, x.shape))
  return sampling._map_state(place, state)


def abstract_sampler_params(config: ModelConfig, mesh: Mesh, *, dtype: Any, param_dtype: Any,
                            copy: bool) -> tuple[nnx.GraphDef, nnx.State]:
  """The sampler's graph and what it reads: the parameters in `param_dtype`, or with `copy` a
  pod host's copy of them, its matmul weights in `dtype` (multihost.Processes.sampler_copy)."""
  graphdef, params = abstract_params(config, mesh, dtype=dtype, param_dtype=param_dtype,
                                     remat="none")
  return graphdef, abstract_matmul_copy(params, dtype) if copy else params


@dataclasses.dataclass(frozen=True)
class SamplerShape:
  """What the sampler's memory depends on besides the model and the mesh: `rows` rows of
  `cache_slots` KV-cache slots, a prefill of `prefill_tokens` tokens a row reading
  `prefill_window` slots (None: all) and decode calls of `max_new_tokens` tokens, the numerics,
  and with `copy` a pod host's copy of the policy (its matmul weights in `dtype`,
  multihost.Processes.sampler_copy) read instead of the parameters in `param_dtype`."""

  rows: int
  cache_slots: int
  prefill_tokens: int = 1024
  max_new_tokens: int = 512
  prefill_window: int | None = None
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  copy: bool = False


def lower_sampler(config: ModelConfig, mesh: Mesh,
                  shape: SamplerShape) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
  """The sampler's prefill and decode programs, as `Sampler` jits them, on abstract inputs.
  Decode reads the rows' live slots, whatever their number (no window)."""
  graphdef, params = abstract_sampler_params(config, mesh, dtype=shape.dtype,
                                             param_dtype=shape.param_dtype, copy=shape.copy)
  rows = shape.rows
  state = abstract_sampler_state(config, mesh, rows, shape.cache_slots, shape.dtype)
  per_row = lambda *dims: jax.ShapeDtypeStruct(
      (rows,) + dims, jnp.int32, sharding=sharding.named_sharding(mesh, ("batch",) +
                                                                  (None,) * len(dims),
                                                                  (rows,) + dims))
  replicated = NamedSharding(mesh, PartitionSpec())
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows))
  keys = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=replicated)
  stop_ids = jax.ShapeDtypeStruct((sampling.MAX_STOP_IDS,), jnp.int32, sharding=replicated)
  # The functions Sampler compiles, with its static arguments and donated state.
  prefill = jax.jit(functools.partial(sampling._prefill, graphdef), static_argnames=("window",),
                    donate_argnums=(1,))
  decode = jax.jit(functools.partial(sampling._decode, graphdef),
                   static_argnames=("width", "sampling"), donate_argnums=(1,))
  with jax.set_mesh(mesh):
    return (prefill.lower(params, state, per_row(shape.prefill_tokens), per_row(),
                          window=shape.prefill_window or shape.cache_slots),
            decode.lower(params, state, keys, per_row(), per_row(), stop_ids, width=shape.max_new_tokens,
                         sampling=sampling.SamplingParams()))


def plan_sampler(config: ModelConfig, mesh: Mesh, shape: SamplerShape, *,
                 compile: bool = True) -> SamplerPlan:
  """Per-device memory of the sampler (`lower_sampler`); compiles prefill and decode unless
  `compile` is False."""
  _, params = abstract_sampler_params(config, mesh, dtype=shape.dtype,
                                      param_dtype=shape.param_dtype, copy=shape.copy)
  state = abstract_sampler_state(config, mesh, shape.rows, shape.cache_slots, shape.dtype)
  figures = dict(mesh_shape=tuple(mesh.shape[a] for a in sharding.MESH_AXES), rows=shape.rows,
                 cache_slots=shape.cache_slots, param_bytes=device_bytes(params),
                 cache_bytes=device_bytes((state.cache.k, state.cache.v)))
  if compile:
    start = time.perf_counter()
    programs = [lowered.compile() for lowered in lower_sampler(config, mesh, shape)]
    figures["compile_seconds"] = time.perf_counter() - start
    stats = [program.memory_analysis() for program in programs]
    if None not in stats:
      prefill, decode = (
          s.temp_size_in_bytes + s.output_size_in_bytes - s.alias_size_in_bytes for s in stats)
      figures.update(prefill_bytes=prefill, decode_bytes=decode)
  return SamplerPlan(**figures)


def plan_table(model: str, plans: Sequence[MemoryPlan]) -> str:
  """A fixed-width table, one row per mesh layout, sizes in GiB per device (with an adapters
  column when a plan is LoRA's)."""
  gib = lambda n: "-" if n is None else f"{n / 2**30:.2f}"
  lora = any(p.adapter_bytes for p in plans)
  header = (f"{'mesh (d,f,t)':>13} {'batch x seq':>12} {'params':>8} " +
            (f"{'adapters':>8} " if lora else "") + f"{'optimizer':>9} "
            f"{'temp':>8} {'peak':>8} {'reference':>9} {'+ ref':>8} {'compile s':>9}")
  lines = [
      f"{model}: {plans[0].num_params / 1e9:.2f}B parameters; GiB per device", header,
      "-" * len(header)
  ]
  for p in plans:
    compile_seconds = "-" if p.compile_seconds is None else f"{p.compile_seconds:.0f}"
    lines.append(f"{','.join(map(str, p.mesh_shape)):>13} {f'{p.batch} x {p.seq}':>12} "
                 f"{gib(p.param_bytes):>8} " + (f"{gib(p.adapter_bytes):>8} " if lora else "") +
                 f"{gib(p.optimizer_bytes):>9} {gib(p.temp_bytes):>8} "
                 f"{gib(p.peak_bytes):>8} {gib(p.reference_bytes):>9} "
                 f"{gib(p.peak_bytes and p.peak_bytes + p.reference_bytes):>8} "
                 f"{compile_seconds:>9}")
  return "\n".join(lines)


def format_sampler_table(model: str, plans: Sequence[SamplerPlan]) -> str:
  """A fixed-width table of sampler plans, one row per mesh layout, GiB per device."""
  gib = lambda n: "-" if n is None else f"{n / 2**30:.2f}"
  header = (f"{'mesh (d,f,t)':>13} {'rows x slots':>13} {'params':>8} {'kv cache':>8} "
            f"{'prefill':>8} {'decode':>8} {'peak':>8} {'compile s':>9}")
  lines = [f"{model} sampler: GiB per device", header, "-" * len(header)]
  for p in plans:
    compile_seconds = "-" if p.compile_seconds is None else f"{p.compile_seconds:.0f}"
    lines.append(f"{','.join(map(str, p.mesh_shape)):>13} "
                 f"{f'{p.rows} x {p.cache_slots}':>13} {gib(p.param_bytes):>8} "
                 f"{gib(p.cache_bytes):>8} {gib(p.prefill_bytes):>8} {gib(p.decode_bytes):>8} "
                 f"{gib(p.peak_bytes):>8} {compile_seconds:>9}")
  return "\n".join(lines)
