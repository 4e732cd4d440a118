"""Per-device memory of a policy's RL update step on a mesh, planned from abstract arrays only.

No weights are read and no device memory is allocated: parameters, optimizer state and the batch
are `jax.ShapeDtypeStruct`s carrying their `NamedSharding`s, so a 7B plan for an 8-chip mesh runs
on a workstation (the mesh is made of virtual CPU devices).

    python -m agentgym_jax.plan --model=qwen2.5-7b-instruct --mesh=1,8,1 --mesh=1,4,2 \
        --batch=8 --seq=4096

Per device, for one update step (forward + backward + AdamW on a [batch, seq] token batch):

  params      sum over parameters of its shard's bytes under sharding.LOGICAL_AXIS_RULES
  optimizer   AdamW's two moments, sharded like the parameters: mu in f32, nu in the parameters'
              dtype (as optax keeps it; both f32 with the default f32 parameters)
  temp        XLA's scratch buffer of the compiled step (`memory_analysis().temp_size`): the
              activations the backward keeps under the remat policy, the gradients, one chunk of
              logits at a time, and the fusions' working space
  peak        arguments + outputs that do not reuse a donated argument + temp

params and optimizer are exact: they follow from the shardings alone. temp is the XLA:CPU
compiler's schedule of the same SPMD program; a TPU's differs (other fusions and layouts), so
read it as an estimate. The compiled step's argument bytes are checked against params +
optimizer + batch, which catches a sharding the compiler did not honour.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentgym_jax import sharding
from agentgym_jax.models import weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.rl.losses import chunked_token_logprobs_and_entropy

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


def abstract_params(config: ModelConfig, mesh: Mesh, *, dtype: Any = jnp.bfloat16,
                    param_dtype: Any = jnp.float32,
                    remat: str = "full") -> tuple[nnx.GraphDef, nnx.State]:
  """The model's graph and its parameters as ShapeDtypeStructs with their NamedShardings."""
  model = weights.abstract_model(config, dtype=dtype, param_dtype=param_dtype, remat=remat)
  graphdef, params = nnx.split(model)

  def place(variable: nnx.Variable) -> nnx.Variable:
    shape, dtype = variable.get_value().shape, variable.get_value().dtype
    return variable.replace(jax.ShapeDtypeStruct(
        shape, dtype, sharding=sharding.named_sharding(mesh, variable.axes, shape)))

  return graphdef, jax.tree.map(place, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_optimizer_state(optimizer: optax.GradientTransformation, params: nnx.State,
                             mesh: Mesh) -> Any:
  """The optimizer state as ShapeDtypeStructs: per-parameter moments sharded like parameters."""
  state = jax.eval_shape(optimizer.init, params)
  params_structure = jax.tree.structure(params)
  replicated = NamedSharding(mesh, PartitionSpec())

  def place(subtree):
    if jax.tree.structure(subtree) == params_structure:
      return jax.tree.map(
          lambda moment, param: jax.ShapeDtypeStruct(moment.shape, moment.dtype,
                                                     sharding=param.sharding),
          subtree, params)
    return jax.ShapeDtypeStruct(subtree.shape, subtree.dtype, sharding=replicated)

  return jax.tree.map(place, state,
                      is_leaf=lambda x: jax.tree.structure(x) == params_structure)


def abstract_batch(mesh: Mesh, batch: int, seq: int) -> jax.ShapeDtypeStruct:
  """Token ids [batch, seq], split over data x fsdp like every batch."""
  spec = sharding.logical_to_spec(("batch", "seq"), (batch, seq), mesh)
  return jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, spec))


def lower_forward(config: ModelConfig, mesh: Mesh, batch: int, seq: int, *,
                  dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32) -> jax.stages.Lowered:
  """The jitted forward pass (ids -> logits) lowered on abstract sharded inputs."""
  graphdef, params = abstract_params(config, mesh, dtype=dtype, param_dtype=param_dtype)

  def forward(params, input_ids):
    return nnx.merge(graphdef, params)(input_ids)

  with jax.set_mesh(mesh):
    return jax.jit(forward).lower(params, abstract_batch(mesh, batch, seq))


def adamw(learning_rate: float = 1e-6) -> optax.GradientTransformation:
  """The planned optimizer; its state's size does not depend on the hyper-parameters."""
  return optax.adamw(learning_rate, mu_dtype=jnp.float32)


def lower_train_step(config: ModelConfig, mesh: Mesh, batch: int, seq: int, *,
                     dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
                     remat: str = "full", logits_chunk: int = 1024) -> jax.stages.Lowered:
  """One AdamW step on the token log-likelihood, lowered on abstract sharded inputs.

  The loss has the memory shape of every RL loss: per-token log-probs from chunked logits
  (`chunked_token_logprobs_and_entropy`), so [batch, seq, vocab] never exists at once.
  Parameters and optimizer state are donated and come back with their own shardings.
  """
  graphdef, params = abstract_params(config, mesh, dtype=dtype, param_dtype=param_dtype,
                                     remat=remat)
  optimizer = adamw()
  opt_state = abstract_optimizer_state(optimizer, params, mesh)

  def loss_fn(params, input_ids):
    model = nnx.merge(graphdef, params)
    hidden, _ = model.hidden_states(input_ids)
    targets = jnp.roll(input_ids, -1, axis=1)
    logprobs, _ = chunked_token_logprobs_and_entropy(hidden, targets, model.logits,
                                                     chunk_size=min(logits_chunk, seq))
    return -logprobs.mean()

  def step(params, opt_state, input_ids):
    loss, grads = jax.value_and_grad(loss_fn)(params, input_ids)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  jitted = jax.jit(step, donate_argnums=(0, 1),
                   out_shardings=(shardings(params), shardings(opt_state),
                                  NamedSharding(mesh, PartitionSpec())))
  with jax.set_mesh(mesh):
    return jitted.lower(params, opt_state, abstract_batch(mesh, batch, seq))


def plan(config: ModelConfig, mesh: Mesh, batch: int, seq: int, *, dtype: Any = jnp.bfloat16,
         param_dtype: Any = jnp.float32, remat: str = "full", logits_chunk: int = 1024,
         compile: bool = True) -> MemoryPlan:
  """Per-device memory of one update step; compiles the step unless `compile` is False."""
  _, params = abstract_params(config, mesh, dtype=dtype, param_dtype=param_dtype, remat=remat)
  opt_state = abstract_optimizer_state(adamw(), params, mesh)
  figures = dict(
      mesh_shape=tuple(mesh.shape[a] for a in sharding.MESH_AXES), batch=batch, seq=seq,
      num_params=config.num_params, param_bytes=device_bytes(params),
      optimizer_bytes=device_bytes(opt_state),
      batch_bytes=device_bytes(abstract_batch(mesh, batch, seq)))
  if compile:
    start = time.perf_counter()
    compiled = lower_train_step(config, mesh, batch, seq, dtype=dtype, param_dtype=param_dtype,
                                remat=remat, logits_chunk=logits_chunk).compile()
    figures["compile_seconds"] = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is not None:
      figures.update(temp_bytes=stats.temp_size_in_bytes,
                     argument_bytes=stats.argument_size_in_bytes,
                     output_bytes=stats.output_size_in_bytes,
                     alias_bytes=stats.alias_size_in_bytes)
  return MemoryPlan(**figures)


def format_table(model: str, plans: Sequence[MemoryPlan]) -> str:
  """A fixed-width table, one row per mesh layout, sizes in GiB per device."""
  gib = lambda n: "-" if n is None else f"{n / 2**30:.2f}"
  header = (f"{'mesh (d,f,t)':>13} {'batch x seq':>12} {'params':>8} {'optimizer':>9} "
            f"{'temp':>8} {'peak':>8} {'compile s':>9}")
  lines = [f"{model}: {plans[0].num_params / 1e9:.2f}B parameters; GiB per device", header,
           "-" * len(header)]
  for p in plans:
    compile_seconds = "-" if p.compile_seconds is None else f"{p.compile_seconds:.0f}"
    lines.append(f"{','.join(map(str, p.mesh_shape)):>13} {f'{p.batch} x {p.seq}':>12} "
                 f"{gib(p.param_bytes):>8} {gib(p.optimizer_bytes):>9} {gib(p.temp_bytes):>8} "
                 f"{gib(p.peak_bytes):>8} {compile_seconds:>9}")
  return "\n".join(lines)


def _mesh_shape(text: str) -> tuple[int, int, int]:
  try:
    shape = tuple(int(size) for size in text.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) <= 0:
    raise argparse.ArgumentTypeError(f"--mesh wants three positive sizes data,fsdp,tensor; "
                                     f"got {text!r}")
  return shape


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m agentgym_jax.plan",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="qwen2.5-7b-instruct",
                      help=f"one of {sorted(HF_CONFIGS)}, or a checkpoint dir / config.json")
  parser.add_argument("--mesh", type=_mesh_shape, action="append",
                      help="data,fsdp,tensor (repeatable; default 1,8,1 and 1,4,2)")
  parser.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
  parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
  parser.add_argument("--dtype", default="bfloat16", help="matmul input dtype")
  parser.add_argument("--param_dtype", default="float32", help="parameter storage dtype")
  parser.add_argument("--remat", default="full", choices=["none", "full", "dots"])
  parser.add_argument("--logits_chunk", type=int, default=1024,
                      help="tokens per chunk of the vocabulary projection in the loss")
  parser.add_argument("--no_compile", action="store_true",
                      help="only the exact figures (params, optimizer), without compiling")
  args = parser.parse_args(argv)
  meshes = args.mesh or [(1, 8, 1), (1, 4, 2)]
  try:
    # The mesh is made of virtual CPU devices, as many as the largest mesh needs.
    jax.config.update("jax_num_cpu_devices", max(math.prod(shape) for shape in meshes))
  except RuntimeError:
    pass  # A backend already runs (e.g. under pytest): plan with the devices it has.
  devices = jax.devices("cpu")
  config = model_config(args.model)
  plans = []
  for shape in meshes:
    if math.prod(shape) > len(devices):
      raise SystemExit(f"mesh {shape} needs {math.prod(shape)} devices; this process has "
                       f"{len(devices)} CPU devices (is XLA_FLAGS forcing a device count?)")
    mesh = sharding.make_mesh(*shape, devices=devices[:math.prod(shape)])
    plans.append(plan(config, mesh, args.batch, args.seq, dtype=jnp.dtype(args.dtype),
                      param_dtype=jnp.dtype(args.param_dtype), remat=args.remat,
                      logits_chunk=args.logits_chunk, compile=not args.no_compile))
  print(format_table(args.model, plans))


if __name__ == "__main__":
  main(sys.argv[1:])
