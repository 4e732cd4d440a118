"""Checkpointer: bit-exact round trips, retention, sharded restore, crash safety, clear errors."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from agentgym_jax.checkpoint import Checkpointer
from agentgym_jax.sharding import make_mesh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_OPTIMIZER = optax.adamw(1e-3, weight_decay=0.01)


@jax.jit  # One compilation instead of dozens of eager ops.
def _one_adamw_update(params):
  opt_state = _OPTIMIZER.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  updates, opt_state = _OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _train_state(seed: int = 0) -> dict:
  """Params of mixed dtypes, an AdamW state after one update (non-zero moments) and a key."""
  rng = np.random.default_rng(seed)
  params, opt_state = _one_adamw_update({
      "embed": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
      "layers": {
          "mlp": jnp.asarray(rng.normal(size=(2, 8, 4)), jnp.bfloat16), "norm": jnp.ones(
              (8,), jnp.float32)
      },
  })
  return {
      "params": params, "opt_state": opt_state, "step": jnp.asarray(7, jnp.int32),
      "rng": jax.random.key_data(jax.random.key(seed)), "typed_rng": jax.random.key(seed)
  }


def _assert_trees_bit_equal(actual, expected) -> None:
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype and a.shape == e.shape
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def test_round_trip_is_bit_exact_with_adamw_state_prng_key_and_meta(tmp_path):
  state = _train_state()
  meta = {
      "step": 7, "rng": [int(v) for v in jax.random.key_data(jax.random.key(3))],
      "horizon_stage": 1, "task_cursor": {"epoch": 0, "index": 96},
      "config": {"lr": 1e-6, "caps": [10, 20, 30]}, "metrics": {"reward/mean": 0.25}
  }
  with Checkpointer(tmp_path, keep=2) as checkpointer:
    assert checkpointer.latest_step() is None
    assert checkpointer.save(7, state, meta)
    assert checkpointer.all_steps() == [7]
    restored, restored_meta = checkpointer.restore(_abstract(state))
  _assert_trees_bit_equal(restored, state)
  # The optax namedtuples come back as namedtuples, so the optimizer accepts them again.
  assert type(restored["opt_state"][0]) is type(state["opt_state"][0])
  assert restored_meta == meta


def test_restore_mimics_concrete_arrays_and_reads_meta_alone(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(1, state, {"step": 1})
    # A freshly initialized state of the same structure is a valid target.
    restored, _ = checkpointer.restore(_train_state(seed=1))
    assert checkpointer.read_meta() == {"step": 1}
  _assert_trees_bit_equal(restored, state)


def test_async_save_is_complete_after_wait_and_on_reopen(tmp_path):
  state = _train_state()
  with Checkpointer(tmp_path, async_save=True) as checkpointer:
    assert checkpointer.save(3, state, {"step": 3})
    checkpointer.wait()
    assert checkpointer.latest_step() == 3
  with Checkpointer(tmp_path) as reopened:
    restored, meta = reopened.restore(_abstract(state))
  _assert_trees_bit_equal(restored, state)
  assert meta == {"step": 3}


def test_keeps_newest_n_plus_every_kth_and_saves_every_nth(tmp_path):
  state = {"w": jnp.zeros((2,))}
  with Checkpointer(tmp_path, keep=2, keep_every=4, save_every=2) as checkpointer:
    saved = [
        step for step in range(1, 13)
        if checkpointer.save(step, jax.tree.map(lambda x: x + step, state), {"step": step})
    ]
    # save_every=2 writes the even steps; keep=2 keeps 10 and 12, keep_every=4 keeps 4 and 8.
    assert saved == [2, 4, 6, 8, 10, 12]
    assert checkpointer.all_steps() == [4, 8, 10, 12]
    # A forced save of an off-schedule step is written; one of a saved step is skipped.
    assert checkpointer.save(13, state, {"step": 13}, force=True)
    assert not checkpointer.save(13, state, {"step": 13}, force=True)
    restored, meta = checkpointer.restore({"w": jnp.zeros((2,))}, step=8)
    np.testing.assert_array_equal(restored["w"], [8.0, 8.0])
    assert meta == {"step": 8}
  assert sorted(os.listdir(tmp_path)) == ["12", "13", "4", "8"]


def test_restore_places_arrays_in_target_named_shardings_on_the_mesh(tmp_path):
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  embed = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
  # Saved from a single device ...
  state = {"params": {"embed": embed, "bias": jnp.arange(8, dtype=jnp.float32)}}
  # ... restored split over fsdp x tensor, the bias replicated.
  targets = {
      "params": {
          "embed": NamedSharding(mesh, PartitionSpec("fsdp", "tensor")),
          "bias": NamedSharding(mesh, PartitionSpec()),
      }
  }
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                          targets)
  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(5, state, {"step": 5})
    restored, _ = checkpointer.restore(abstract)
  restored_embed = restored["params"]["embed"]
  assert restored_embed.sharding == targets["params"]["embed"]
  assert restored["params"]["bias"].sharding == targets["params"]["bias"]
  # Each of the 8 devices holds its own (16/2, 8/2) = (8, 4) block, read from its slice.
  assert len(restored_embed.addressable_shards) == 8
  for shard in restored_embed.addressable_shards:
    assert shard.data.shape == (8, 4)
    np.testing.assert_array_equal(shard.data, embed[shard.index])
  np.testing.assert_array_equal(restored_embed, embed)


_SAVE_THEN_DIE = textwrap.dedent("""
    import os, sys, time
    import jax.numpy as jnp
    from agentgym_jax.checkpoint import Checkpointer

    directory, marker = sys.argv[1], sys.argv[2]
    checkpointer = Checkpointer(directory)
    checkpointer.save(1, {"w": jnp.ones((256, 256))}, {"step": 1})
    checkpointer.wait()

    # Hold the commit (the rename of the temporary directory to "2") until the parent's
    # SIGKILL arrives, so the kill always lands before step 2 is finalized.
    real_rename = os.rename
    def rename(src, dst, *args, **kwargs):
      if os.path.basename(os.fspath(dst)) == "2":
        open(marker, "w").close()
        time.sleep(600)
      return real_rename(src, dst, *args, **kwargs)
    os.rename = rename
    checkpointer.save(2, {"w": jnp.full((256, 256), 2.0)}, {"step": 2})
""")


def _wait_for(condition, process, log, timeout=60.0):
  deadline = time.monotonic() + timeout
  while not condition():
    if process.poll() is not None:
      pytest.fail(f"writer exited early:\n{log.read_text()[-3000:]}")
    if time.monotonic() > deadline:
      process.kill()
      pytest.fail("writer did not reach the kill point")
    time.sleep(0.005)


@pytest.mark.parametrize("kill_point", ["save_started", "data_written"])
def test_kill_during_save_leaves_the_previous_step_as_latest(tmp_path, kill_point):
  directory, marker = tmp_path / "checkpoints", tmp_path / "commit_reached"
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  log = tmp_path / "writer.log"
  with open(log, "w") as log_file:
    process = subprocess.Popen(
        [sys.executable, "-c", _SAVE_THEN_DIE,
         str(directory), str(marker)], env=env, stdout=log_file, stderr=subprocess.STDOUT)

  def temporary_step_2():
    if not directory.exists():
      return []
    return [name for name in os.listdir(directory) if name.startswith("2.")]

  _wait_for(temporary_step_2 if kill_point == "save_started" else marker.exists, process, log)
  process.send_signal(signal.SIGKILL)
  assert process.wait(timeout=30) == -signal.SIGKILL
  assert temporary_step_2(), "the kill should leave an unfinished step-2 directory"

  with Checkpointer(directory) as checkpointer:
    assert checkpointer.all_steps() == [1]
    restored, meta = checkpointer.restore({"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)})
    np.testing.assert_array_equal(restored["w"], np.ones((256, 256), np.float32))
    assert meta == {"step": 1}
    # The resumed run saves step 2 again; the leftover temporary directory is gone.
    assert checkpointer.save(2, {"w": jnp.full((256, 256), 2.0)}, {"step": 2})
    assert checkpointer.all_steps() == [1, 2]
  assert sorted(os.listdir(directory)) == ["1", "2"]


def test_structure_mismatch_names_the_differing_keys(tmp_path):
  with Checkpointer(tmp_path) as checkpointer:
    checkpointer.save(4, {"params": {"w": jnp.zeros((2, 3)), "b": jnp.zeros((3,))}}, {"step": 4})
    expected = {"params": {"w": jnp.zeros((2, 3)), "bias": jnp.zeros((3,))}}
    with pytest.raises(ValueError, match=r"step 4 .*does not expect: params/b;.*"
                       r"expects: params/bias"):
      checkpointer.restore(expected)
    with pytest.raises(ValueError, match=r"params/w: saved \(2, 3\), expected \(3, 3\)"):
      checkpointer.restore({"params": {"w": jnp.zeros((3, 3)), "b": jnp.zeros((3,))}})


def test_unreadable_meta_and_missing_checkpoints_are_reported(tmp_path):
  state = {"w": jnp.zeros((2,))}
  with Checkpointer(tmp_path) as checkpointer:
    with pytest.raises(FileNotFoundError, match="No checkpoint in"):
      checkpointer.restore(state)
    checkpointer.save(1, state, {"step": 1})
    with pytest.raises(FileNotFoundError, match=r"step 5 .*saved steps: \[1\]"):
      checkpointer.restore(state, step=5)
    (tmp_path / "1" / "meta" / "metadata").write_text('{"step": 1, "rng": [0, ')
    with pytest.raises(ValueError, match="step 1 .*unreadable meta"):
      checkpointer.restore(state)


def test_save_rejects_non_json_meta_and_steps_older_than_the_latest(tmp_path):
  state = {"w": jnp.zeros((2,))}
  with Checkpointer(tmp_path) as checkpointer:
    with pytest.raises(TypeError, match="meta for step 1 must be JSON-serializable"):
      checkpointer.save(1, state, {"loss": jnp.zeros(())})
    checkpointer.save(5, state, {"step": 5})
    with pytest.raises(ValueError, match="already holds the newer step 5"):
      checkpointer.save(3, state, {"step": 3})


@pytest.mark.parametrize("field, value", [("keep", 0), ("save_every", 1.5), ("keep_every", -2)])
def test_invalid_retention_settings_are_rejected(tmp_path, field, value):
  with pytest.raises(ValueError, match=f"`{field}` must be a positive integer"):
    Checkpointer(tmp_path, **{field: value})
