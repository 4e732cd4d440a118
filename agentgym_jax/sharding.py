"""The device mesh and the one table that maps logical array axes to mesh axes.

Every array that lives on the mesh (parameters, optimizer state, batches, the KV cache,
activations) names its axes with logical names; `LOGICAL_AXIS_RULES` below is the only place
that decides which mesh axis each logical axis is split over.

Mesh axes:
  data:   pure data parallelism (replicated parameters, split batch).
  fsdp:   data parallelism with parameters and optimizer state split too (ZeRO-3 style).
  tensor: Megatron-style tensor parallelism over heads and the MLP hidden dimension.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    # LoRA's rank: an adapter's A [in..., r] shares its weight's input axes, B [r, out...] its
    # output axes (agentgym_jax/models/lora.py).
    ("lora_rank", None),
    # Activations.
    ("batch", BATCH),
    ("seq", None),
    # The residual stream between blocks (what full remat keeps of every layer) is split along
    # the sequence over `tensor`, whose devices would otherwise each hold the same copy: XLA
    # gathers it before the projections and scatters their reduced outputs back (Megatron's
    # sequence parallelism).
    ("residual_seq", "tensor"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    # KV cache, each layer [batch, kv_heads, cache_seq, head_dim]; decode_attention keeps a row's
    # slots on one device.
    ("cache_seq", None),
)
_RULES = dict(LOGICAL_AXIS_RULES)
# Axes split even where the mesh does not divide them (XLA pads the last shard): a row of
# bucket - 1 tokens, inside jit only.
PADDED_AXES = frozenset({"residual_seq"})


def on_cloud_tpu_vm() -> bool:
  """Whether this is a Cloud TPU VM: JAX's own finding when it was imported (libtpu installed
  and TPU chips on the PCI bus), with no environment variable involved."""
  from jax._src import cloud_tpu_init
  return cloud_tpu_init.running_in_cloud_tpu_vm


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
  """Joins the JAX distributed runtime on multi-host set-ups; a no-op on a single host.

  The arguments (launch/train.py's --coordinator, --num_processes, --process_id) come first,
  then JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID. On a Cloud TPU VM,
  `jax.distributed.initialize()` runs with no arguments: JAX asks the VM's metadata server for
  the slice's workers and this worker's index (GKE's TPU_WORKER_* variables when set), so a
  plain ssh shell on every worker of a pod needs nothing set; a one-host slice joins as one
  process. On CPU the processes' collectives run over Gloo (JAX's default
  `jax_cpu_collectives_implementation`).
  """
  if jax.distributed.is_initialized():
    return
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if coordinator_address:
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes
        or int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]) if process_id is None else process_id)
  elif on_cloud_tpu_vm():
    jax.distributed.initialize()


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh; one axis may be -1 to take the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  shape = [data, fsdp, tensor]
  if shape.count(-1) > 1 or any(size == 0 or size < -1 for size in shape):
    raise ValueError(f"mesh axes must be positive, and at most one may be -1; got data={data} "
                     f"fsdp={fsdp} tensor={tensor}")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not split into a mesh with "
                       f"data={data} fsdp={fsdp} tensor={tensor}")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(f"mesh data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} does not "
                     f"match {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec by LOGICAL_AXIS_RULES.

  With a shape and a mesh, a dimension that the mesh axes do not divide stays replicated (e.g.
  SmolLM2's 3 KV heads on tensor=2), and a mesh axis is never used twice.
  """
  used: set[str] = set()
  spec = []
  for i, name in enumerate(axes):
    if name is not None and name not in _RULES:
      raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES")
    target = _RULES.get(name) if name is not None else None
    mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
    mesh_axes = tuple(a for a in mesh_axes if a not in used)
    if mesh is not None:
      mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
      if (shape is not None and name not in PADDED_AXES
          and shape[i] % math.prod(mesh.shape[a] for a in mesh_axes)):
        mesh_axes = ()
    used.update(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
  return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, axes: Sequence[str | None],
                   shape: Sequence[int] | None = None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def _variable_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
  axes = getattr(variable, "axes", None)
  if axes is None:
    raise ValueError(f"variable of shape {variable.get_value().shape} has no logical axes")
  return tuple(axes)


def state_shardings(state: Any, mesh: Mesh) -> Any:
  """NamedShardings for an nnx.State whose Variables carry `axes` metadata."""
  return jax.tree.map(
      lambda v: v.replace(named_sharding(mesh, _variable_axes(v),
                                         v.get_value().shape)), state,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def train_state_shardings(trainable: Any, opt_state: Any, mesh: Mesh) -> tuple[Any, Any]:
  """(trainable shardings, optimizer-state shardings): each trained array where the model
  loader put it (the logical-axis rules; arrays not yet on the mesh, such as a new value head,
  replicated), each optimizer moment like its array, counters replicated.

  The update step returns its state with exactly these shardings; left to itself, jit gives
  the optimizer's moments no sharding (a replicated copy of every moment on every device) and
  XLA's propagation may choose others between steps, which moves the state and compiles the
  update a second time. `opt_state` may be abstract (jax.eval_shape of the optimizer's init).
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  on_mesh = lambda x: (x.sharding if isinstance(x.sharding, NamedSharding) and x.sharding.mesh ==
                       mesh else replicated)
  trainable_shardings = jax.tree.map(on_mesh, trainable)
  structure = jax.tree.structure(trainable)
  like_trainable = lambda subtree: jax.tree.structure(subtree) == structure
  opt_shardings = jax.tree.map(lambda x: trainable_shardings if like_trainable(x) else replicated,
                               opt_state, is_leaf=like_trainable)
  return trainable_shardings, opt_shardings


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint by logical axes under the current mesh; a no-op without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def batch_shards(mesh: Mesh) -> int:
  """The devices the batch axis splits over: data x fsdp."""
  return math.prod(mesh.shape[axis] for axis in BATCH)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Splits the leading (batch) axis over data and fsdp."""
  return NamedSharding(mesh, PartitionSpec(BATCH, *([None] * (ndim - 1))))
