"""agentgym-plan: per-device memory of a policy's RL update step and sampler on a mesh, from
abstract arrays (agentgym_jax/memory.py says what each figure is).

  agentgym-plan --model=qwen2.5-7b-instruct --mesh=1,8,1 --mesh=1,4,2 --batch=8 --seq=4096
  agentgym-plan --mesh=1,8,1 --batch=8 --seq=4096 --lora_rank=64
  agentgym-plan --sampler_mesh=1,4,1 --rows=64 --cache_slots=10240

(From a checkout, `python launch/plan.py` with the same flags.) No weights are read:
a 7B plan for an 8-chip mesh runs on a workstation, on virtual CPU devices (--devices, by
default as many as the largest mesh needs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from absl import app, flags

from agentgym_jax import cli, memory, sharding
from agentgym_jax.models import attention
from agentgym_jax.models import lora as lora_lib

_DTYPES = ["bfloat16", "float32", "float16"]
_MODEL = flags.DEFINE_string(
    "model", "qwen2.5-7b-instruct",
    f"One of {', '.join(memory.HF_CONFIGS)}, or a checkpoint directory or "
    "config.json.")
_MESH = flags.DEFINE_multi_string(
    "mesh", None, "data,fsdp,tensor of an update step (repeatable; default 1,8,1 and 1,4,2 "
    "unless only samplers are planned).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step (global).", lower_bound=1)
_SEQ = flags.DEFINE_integer("seq", 4096, "Tokens per sequence.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", _DTYPES, "Matmul input dtype.")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "float32", _DTYPES, "Parameter storage dtype.")
_REMAT = flags.DEFINE_enum("remat", "full", ["none", "full", "dots"],
                           "What the backward pass recomputes.")
_ATTENTION = flags.DEFINE_enum("attention", "auto", list(attention.IMPLEMENTATIONS),
                               "The learner's attention (auto: splash on TPU, flash elsewhere).")
_LOGITS_CHUNK = flags.DEFINE_integer("logits_chunk", 1024,
                                     "Tokens per chunk of the vocabulary projection in the loss.",
                                     lower_bound=1)
_MICRO_BATCH_ROWS = flags.DEFINE_integer(
    "micro_batch_rows", 0, "Rows per forward/backward pass of the update (0: the whole batch).",
    lower_bound=0)
_LORA_RANK = flags.DEFINE_integer(
    "lora_rank", 0, "Plan LoRA's update with adapters of this rank (0: full fine-tuning).",
    lower_bound=0)
_LORA_TARGETS = flags.DEFINE_list("lora_targets", list(lora_lib.TARGETS),
                                  "The adapted projections, comma-separated.")
_SAMPLER_MESH = flags.DEFINE_multi_string("sampler_mesh", None,
                                          "data,fsdp,tensor of a sampler (repeatable).")
_ROWS = flags.DEFINE_integer("rows", 256, "Sampler rows (episodes at once).", lower_bound=1)
_CACHE_SLOTS = flags.DEFINE_integer("cache_slots", 10240, "KV-cache slots per row.", lower_bound=1)
_PREFILL = flags.DEFINE_integer("prefill", 1024, "Tokens appended per prefill.", lower_bound=1)
_PREFILL_WINDOW = flags.DEFINE_integer("prefill_window", None,
                                       "Cache slots a prefill attends to (default: all of them).",
                                       lower_bound=1)
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 512, "Tokens per decode call.",
                                       lower_bound=1)
_SAMPLER_COPY = flags.DEFINE_bool(
    "sampler_copy", False, "The sampler reads a pod host's copy of the policy, its matmul "
    "weights in --dtype (multihost.Processes.sampler_copy), not the parameters.")
_DEVICES = flags.DEFINE_integer(
    "devices", None, "Virtual CPU devices (default: as many as the largest mesh needs).",
    lower_bound=1)
_NO_COMPILE = flags.DEFINE_bool(
    "no_compile", False, "Only the exact figures (params, optimizer, cache), without compiling.")


def mesh_shape(text: str, flag: str) -> tuple[int, int, int]:
  """(data, fsdp, tensor) from "1,8,1"; a UsageError names `flag` otherwise."""
  try:
    shape = tuple(int(size) for size in text.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) <= 0:
    raise app.UsageError(f"--{flag}={text}: wants three positive sizes data,fsdp,tensor")
  return shape


def _plan() -> None:
  sampler_meshes = [mesh_shape(text, "sampler_mesh") for text in _SAMPLER_MESH.value or []]
  meshes = ([mesh_shape(text, "mesh") for text in _MESH.value]
            if _MESH.value else [] if sampler_meshes else [(1, 8, 1), (1, 4, 2)])
  unknown = [target for target in _LORA_TARGETS.value if target not in lora_lib.TARGETS]
  if unknown:
    raise app.UsageError(f"--lora_targets: {', '.join(unknown)} is not one of "
                         f"{', '.join(lora_lib.TARGETS)}")
  try:
    config = memory.model_config(_MODEL.value)
  except FileNotFoundError as error:
    raise app.UsageError(f"--model={_MODEL.value}: {error}") from None
  try:
    # The mesh is made of virtual CPU devices.
    jax.config.update("jax_num_cpu_devices", _DEVICES.value
                      or max(math.prod(shape) for shape in meshes + sampler_meshes))
  except RuntimeError:
    pass  # A backend already runs: plan with the devices it has.
  devices = jax.devices("cpu")
  for shape in meshes + sampler_meshes:
    if math.prod(shape) > len(devices):
      raise app.UsageError(
          f"mesh {shape} needs {math.prod(shape)} devices; this process has {len(devices)} CPU "
          "devices (is XLA_FLAGS forcing a device count?)")
  dtypes = dict(dtype=jnp.dtype(_DTYPE.value), param_dtype=jnp.dtype(_PARAM_DTYPE.value))
  lora = None
  if _LORA_RANK.value:
    # alpha scales the adapters' values only; no memory figure depends on it.
    lora = lora_lib.LoraSettings(rank=_LORA_RANK.value, alpha=float(_LORA_RANK.value),
                                 targets=tuple(_LORA_TARGETS.value))

  def make_mesh(shape):
    return sharding.make_mesh(*shape, devices=devices[:math.prod(shape)])

  step = memory.StepShape(_BATCH.value, _SEQ.value, remat=_REMAT.value, attention=_ATTENTION.value,
                          logits_chunk=_LOGITS_CHUNK.value,
                          micro_batch_rows=_MICRO_BATCH_ROWS.value, lora=lora, **dtypes)
  sampler = memory.SamplerShape(_ROWS.value, _CACHE_SLOTS.value, prefill_tokens=_PREFILL.value,
                                max_new_tokens=_MAX_NEW_TOKENS.value,
                                prefill_window=_PREFILL_WINDOW.value, copy=_SAMPLER_COPY.value,
                                **dtypes)
  tables = []
  if meshes:
    tables.append(
        memory.plan_table(_MODEL.value, [
            memory.plan(config, make_mesh(shape), step, compile=not _NO_COMPILE.value)
            for shape in meshes
        ]))
  if sampler_meshes:
    tables.append(
        memory.format_sampler_table(_MODEL.value, [
            memory.plan_sampler(config, make_mesh(shape), sampler, compile=not _NO_COMPILE.value)
            for shape in sampler_meshes
        ]))
  print("\n\n".join(tables))


def main() -> None:
  """agentgym-plan."""
  cli.run(_plan)
