"""Training on several processes (hosts): who plays which rollouts, and what crosses processes.

Under the JAX distributed runtime every process runs the same train loop; the learner's arrays
live on one global mesh over all processes' devices, and each jitted learner step runs SPMD on
it. Rollouts are played per process:

  rows         process p plays rows [p * R / P, (p + 1) * R / P) of the step's R = tasks x
               samples trajectories, with its own env pool of R / P slots
  local_mesh   on a sampler over the block of the training mesh made of its own devices
  local_copy   holding a full copy of the policy there (an all-gather over the processes that
               share a parameter shard, then the local shards re-wrapped as process-local arrays);
               the sampler's (sampler_copy) keeps its matmul weights in the matmul dtype
  gather       the trajectories then go to every process, so each packs the same global batch
               and logs the same metrics; placing that host batch with `jax.device_put` on the
               global mesh copies to each device only its own rows.

Advantages are computed on the global batch, so a GRPO group is normalised over all its
samples wherever they were played. The sampler draws row r's tokens from fold_in(key, r) with
the global row r (`rollout.collect`'s first_row), so P processes sample what one process
sampling all R rows would.

On one process every function here is the identity: the sampler shares the training mesh and
the parameters, and nothing is gathered.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Sequence, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from agentgym_jax import rollout, sharding
from agentgym_jax.models import decoder

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Processes:
  """This process's index among `count` and its block of the global mesh."""

  mesh: Mesh
  index: int
  count: int
  local_mesh: Mesh

  @classmethod
  def of(cls, mesh: Mesh) -> Processes:
    """The processes of `mesh`, which must give every process a block of the same shape."""
    count = jax.process_count()
    if count == 1:
      return cls(mesh, 0, 1, mesh)
    return cls(mesh, jax.process_index(), count, _process_block(mesh, jax.process_index()))

  def rows(self, num_rows: int) -> range:
    """The rows of a step's `num_rows` trajectories that this process plays."""
    if num_rows % self.count:
      raise ValueError(f"{num_rows} trajectories per step do not split over {self.count} "
                       "processes; make tasks_per_step x samples_per_task a multiple")
    size = num_rows // self.count
    return range(self.index * size, (self.index + 1) * size)

  def share(self, items: Sequence[T]) -> list[T]:
    """This process's share of `items` (every count-th item), e.g. evaluation tasks."""
    return list(items[self.index::self.count])

  def gather(self, items: Sequence[T]) -> list[T]:
    """Every process's `items` (picklable), concatenated in process order, on every process."""
    if self.count == 1:
      return list(items)
    return [item for part in all_gather_objects(list(items)) for item in part]

  def gather_rollout(
      self, trajectories: Sequence[rollout.Trajectory],
      stats: rollout.RolloutStats) -> tuple[list[rollout.Trajectory], rollout.RolloutStats]:
    """All processes' trajectories in row order; tokens summed, times of the slowest process
    (and the least hidden env time, so the hidden fraction is a lower bound)."""
    if self.count == 1:
      return list(trajectories), stats
    parts = all_gather_objects((list(trajectories), stats))
    every = [s for _, s in parts]
    # Counts add up over processes (RolloutStats.total); times are the slowest process's.
    total = dataclasses.replace(rollout.RolloutStats.total(every),
                                generate_s=max(s.generate_s for s in every),
                                env_s=max(s.env_s for s in every),
                                env_hidden_s=min(s.env_hidden_s for s in every))
    return [t for played, _ in parts for t in played], total

  def sampler_copy(self, params: Any, dtype: Any) -> Any:
    """The policy as this process's sampler reads it: `params` themselves on one process; on
    a pod a `local_copy` whose matmul weights are in the matmul `dtype`
    (decoder.matmul_copy: the same tokens and log-probs, from half the bytes in bf16), cast
    before the gather so that the gather moves half the bytes too. A collective."""
    if self.count == 1:
      return params
    return self.local_copy(decoder.matmul_copy(params, dtype))

  def local_copy(self, params: Any) -> Any:
    """The parameters as arrays on `local_mesh` only, laid out by the logical axis rules.

    Every process must call this at the same point (it is a collective).
    """
    if self.count == 1:
      return params
    local = sharding.state_shardings(params, self.local_mesh)
    blocks = np.stack([_process_block(self.mesh, p).devices for p in range(self.count)])
    replicas_mesh = Mesh(blocks, ("processes",) + self.local_mesh.axis_names)
    replicas = jax.device_put(params,
                              jax.tree.map(lambda s: NamedSharding(replicas_mesh, s.spec), local))
    return jax.tree.map(
        lambda x, s: jax.make_array_from_single_device_arrays(
            x.shape, s, [shard.data for shard in x.addressable_shards]), replicas, local)


def _process_block(mesh: Mesh, process: int) -> Mesh:
  """The sub-mesh of `process`'s devices: a box of the mesh's device array."""
  owned = np.vectorize(lambda d: d.process_index == process)(mesh.devices)
  corners = np.argwhere(owned)
  box = tuple(slice(low, high + 1) for low, high in zip(corners.min(0), corners.max(0)))
  if not owned[box].all():
    raise ValueError(f"process {process}'s devices are not a block of the mesh "
                     f"{dict(mesh.shape)}; order the devices by process")
  return Mesh(mesh.devices[box], mesh.axis_names)


def all_gather_objects(value: Any) -> list[Any]:
  """Every process's picklable `value`, in process order (a collective, as bytes)."""
  data = np.frombuffer(pickle.dumps(value), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  gathered = multihost_utils.process_allgather(padded)
  return [pickle.loads(row[:int(size)].tobytes()) for row, size in zip(gathered, sizes[:, 0])]
