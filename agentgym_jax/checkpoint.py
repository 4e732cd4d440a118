"""Checkpoints of a training run: the train-state pytree plus a JSON `meta` record, via Orbax.

One checkpoint per saved step lives in `<directory>/<step>/` with two items:

  state  any JAX pytree (params, optimizer state, value params, PRNG key data, ...), written
         with Orbax's StandardCheckpointHandler (tensorstore/OCDBT). Sharded arrays are written
         shard by shard from every host and read back straight into their target shardings.
  meta   a JSON-able dict: step, PRNG key data, horizon stage, task cursor, config, metrics
         summary; everything a resumed run needs that is not an array.

Atomicity. Orbax writes a step into `<step>.orbax-checkpoint-tmp-<n>/` and renames it to
`<step>/` only after every array and the meta are on disk (on object stores without atomic
rename it writes a commit_success.txt marker instead). `all_steps` and `latest_step` list only
finalized steps, so a run killed mid-write is resumed from the previous complete step; the
unfinished temporary directory is deleted when the directory is next opened.

Retention. The newest `keep` steps are kept; with `keep_every=K` every step divisible by K is
kept forever as well (e.g. keep=3, keep_every=100 keeps 100, 200, ... and the last three).

Usage in a train loop:

  with Checkpointer(workdir / "checkpoints", keep=3, save_every=50) as checkpointer:
    if checkpointer.latest_step() is not None:
      state, meta = checkpointer.restore(abstract_state)   # ShapeDtypeStructs with .sharding
      start = meta["step"] + 1
    for step in range(start, num_steps):
      state, metrics = train_step(state, batch)
      checkpointer.save(step, state, meta_for(step), force=step == num_steps - 1)
  # leaving the block waits for an async save and closes the manager

`save` returns once the arrays are copied off the device (async_save=True) or written
(async_save=False); the caller may donate the state's buffers right after it returns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

_STATE = "state"
_META = "meta"
_SHOWN_KEYS = 8  # Key paths listed per side in a structure-mismatch error.


def _key_name(key: Any) -> str:
  """One component of a pytree key path as Orbax names it ("params", "0", "count")."""
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _stored_shape(leaf: Any) -> tuple[int, ...] | None:
  """The shape Orbax records for a leaf: typed PRNG keys as their key data, scalars None."""
  if not hasattr(leaf, "shape"):
    return None
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
  return tuple(leaf.shape)


def _leaf_shapes(tree: Any) -> dict[str, tuple[int, ...] | None]:
  """Maps "a/b/0/c" key paths of a pytree's leaves to their stored shapes.

  Orbax stores tuples and namedtuples (optax states) as lists and dicts keyed by position and
  field name, so paths built from DictKey / GetAttrKey / SequenceKey names agree between a
  live train state and a checkpoint's metadata tree.
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(_key_name(k) for k in path): _stored_shape(leaf) for path, leaf in leaves}


def _abstract_leaf(leaf: Any) -> Any:
  """A concrete jax.Array becomes the ShapeDtypeStruct it mimics, sharding included."""
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


def _listing(paths: Sequence[str]) -> str:
  shown = ", ".join(paths[:_SHOWN_KEYS])
  more = len(paths) - _SHOWN_KEYS
  return shown + (f", ... ({more} more)" if more > 0 else "")


def _check_positive_int(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"Checkpointer `{name}` must be a positive integer, got {value!r}.")


class Checkpointer:
  """Saves, prunes and restores the checkpoints of one run in one directory.

  Args:
    directory: where the step directories live (local path or a URL Orbax understands, such
      as gs://bucket/run/checkpoints). Created if missing.
    keep: how many of the newest checkpoints to keep.
    keep_every: if set, steps divisible by it are never pruned.
    save_every: `should_save(step)` is true for steps divisible by it.
    async_save: write in a background thread after the device-to-host copy; call `wait()`
      (or `close()`, or leave the `with` block) before the process exits.
  """

  def __init__(self, directory: str | os.PathLike[str], keep: int = 3,
               keep_every: int | None = None, save_every: int = 1, async_save: bool = False):
    _check_positive_int("keep", keep)
    _check_positive_int("save_every", save_every)
    if keep_every is not None:
      _check_positive_int("keep_every", keep_every)
    directory = os.fspath(directory)
    # Orbax's tensorstore specs need absolute local paths; URLs pass through untouched.
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        keep_period=keep_every,
        enable_async_checkpointing=async_save,
        # Unfinished `<step>.orbax-checkpoint-tmp-*` directories of a killed run are removed.
        cleanup_tmp_directories=True,
        create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=(_STATE, _META),
        item_handlers={_STATE: ocp.StandardCheckpointHandler(), _META: ocp.JsonCheckpointHandler()})

  def should_save(self, step: int) -> bool:
    """Whether `step` is a scheduled save step (divisible by `save_every`)."""
    return step % self.save_every == 0

  def all_steps(self) -> list[int]:
    """The finalized (complete) checkpoint steps, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest finalized step, or None in a fresh directory."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: Mapping[str, Any], force: bool = False) -> bool:
    """Writes `state` and `meta` as checkpoint `step` if `should_save(step)` or `force`.

    A step that is already saved is not written again (so a final forced save after the loop
    saved the same step is harmless). Returns whether a checkpoint was started.
    """
    if not (force or self.should_save(step)):
      return False
    steps = self.all_steps()
    if step in steps:
      logging.info("Checkpoint for step %d already exists in %s; not saving it again.", step,
                   self.directory)
      return False
    if steps and step < steps[-1]:
      raise ValueError(
          f"Cannot save step {step} in {self.directory}: it already holds the newer step "
          f"{steps[-1]}. A run restarted from an earlier step needs a fresh directory (or the "
          "newer steps removed).")
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise TypeError(f"Checkpoint meta for step {step} must be JSON-serializable: {e}") from e
    self._manager.save(
        step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(state),
            _META: ocp.args.JsonSave(dict(meta)),
        }), force=True)
    return True

  def read_meta(self, step: int | None = None) -> dict[str, Any]:
    """The meta dict of `step` (default: the latest step), without reading any array."""
    step = self._existing_step(step)
    try:
      restored = self._manager.restore(step,
                                       args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
      meta = restored[_META]
    except Exception as e:  # Orbax surfaces I/O and JSON errors with many exception types.
      raise ValueError(f"Checkpoint at step {step} in {self.directory} has an unreadable meta "
                       f"record: {type(e).__name__}: {e}") from e
    if not isinstance(meta, dict):
      raise ValueError(f"Checkpoint at step {step} in {self.directory} has a meta record of "
                       f"type {type(meta).__name__}, expected a JSON object.")
    return meta

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Reads checkpoint `step` (default: the latest) into the structure of `abstract_state`.

    Args:
      abstract_state: the pytree the run expects, with jax.ShapeDtypeStruct leaves whose
        `.sharding` says where each array goes (e.g. NamedShardings on the run's mesh, so each
        host reads only its shards), or concrete arrays whose shape, dtype and sharding are
        mimicked. A ShapeDtypeStruct without a sharding falls back to the sharding recorded
        at save time, which only works on the same device topology. Arrays are cast to the
        target dtype.
      step: the step to restore; None for the latest.

    Returns:
      (state, meta): the restored pytree and the meta dict saved with it.

    Raises:
      FileNotFoundError: no checkpoint (or none for `step`) in the directory.
      ValueError: the checkpoint's keys or shapes differ from `abstract_state`, or its meta
        cannot be read.
    """
    step = self._existing_step(step)
    meta = self.read_meta(step)
    target = jax.tree.map(_abstract_leaf, abstract_state)
    self._check_structure(step, target)
    restored = self._manager.restore(
        step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)}))
    return restored[_STATE], meta

  def wait(self) -> None:
    """Blocks until an in-flight async save is finalized on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's threads."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def _existing_step(self, step: int | None) -> int:
    self.wait()  # A step being written asynchronously becomes readable once finalized.
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(f"No checkpoint for step {step} in {self.directory}; saved "
                              f"steps: {steps}.")
    return step

  def _check_structure(self, step: int, target: Any) -> None:
    """Raises a readable error when the saved tree and the expected tree disagree.

    Orbax's own errors on a mismatch print whole metadata trees; a resumed run with a
    different model or optimizer deserves a list of the offending keys instead.
    """
    try:
      saved_tree = self._manager.item_metadata(step)[_STATE].tree
    except Exception as e:  # As in read_meta: any I/O or format error.
      raise ValueError(f"Checkpoint at step {step} in {self.directory} has unreadable array "
                       f"metadata: {type(e).__name__}: {e}") from e
    saved, expected = _leaf_shapes(saved_tree), _leaf_shapes(target)
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    if missing or unexpected:
      differences = []
      if unexpected:
        differences.append(f"it has keys the run does not expect: {_listing(unexpected)}")
      if missing:
        differences.append(f"it lacks keys the run expects: {_listing(missing)}")
      raise ValueError(
          f"Checkpoint at step {step} in {self.directory} does not match the run's state; " +
          "; ".join(differences) + ". Was it written by a run with another model, optimizer "
          "or trainer version?")
    wrong_shape = [
        f"{path}: saved {saved[path]}, expected {expected[path]}" for path in sorted(expected)
        if expected[path] is not None and saved[path] is not None and saved[path] != expected[path]
    ]
    if wrong_shape:
      raise ValueError(f"Checkpoint at step {step} in {self.directory} has arrays of other "
                       f"shapes than the run expects: {_listing(wrong_shape)}.")
