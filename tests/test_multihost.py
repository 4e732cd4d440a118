"""launch/train.py on two processes (JAX distributed runtime, Gloo collectives on CPU), each with
its own env pool and sampler rows, trains as one process does with the same global config."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tiny
from agentgym_jax import metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3
# One-turn echo episodes, which a random policy sometimes gets right; 4 tasks x 4 samples. Each
# process plays 2 tasks on 2 devices, and the mesh's fsdp axis (4 devices) spans both processes,
# so the sampler's copy of the policy is gathered.
SETTINGS = [f"--config.steps={STEPS}", "--config.env.options.turns=1", "--config.horizon.turns=1",
            "--config.rollout.tasks_per_step=4",
            "--config.rollout.samples_per_task=4", "--config.mesh.fsdp=-1",
            f"--config.checkpoint.every={STEPS}", "--config.log.trajectories=True"]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
  return str(tiny.make_checkpoint(tmp_path_factory.mktemp("tiny")))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(workdir: pathlib.Path, checkpoint_dir: str, devices: int, *flags: str):
  command = [sys.executable, str(REPO / "launch" / "train.py"),
             f"--config={REPO / 'configs' / 'ablation_echo.py'}:long", f"--workdir={workdir}",
             f"--config.model.name={checkpoint_dir}", *SETTINGS, *flags]
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)


def _wait(processes: list[subprocess.Popen]) -> list[str]:
  """Each process's stderr; a process still running after TIMEOUT_S fails the test (a hang)."""
  errors = []
  try:
    for process in processes:
      errors.append(process.communicate(timeout=TIMEOUT_S)[1])
  except subprocess.TimeoutExpired:
    for process in processes:
      process.kill()
    pytest.fail(f"a training process did not finish within {TIMEOUT_S} s")
  for process, stderr in zip(processes, errors):
    assert process.returncode == 0, stderr[-3000:]
  return errors


def _final_state(workdir: pathlib.Path) -> dict[str, np.ndarray]:
  """The last checkpoint's arrays by path, read onto this process's one device."""
  path = workdir / "checkpoints" / str(STEPS) / "state"
  with ocp.StandardCheckpointer() as checkpointer:
    stored = checkpointer.metadata(path).item_metadata.tree
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          stored)
    state = checkpointer.restore(path, target)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def test_two_processes_train_as_one_process(checkpoint_dir, tmp_path):
  port = _free_port()
  two = [_launch(tmp_path / "two", checkpoint_dir, 2, f"--coordinator=localhost:{port}",
                 "--num_processes=2", f"--process_id={i}") for i in range(2)]
  one = _launch(tmp_path / "one", checkpoint_dir, 4)
  _wait(two + [one])

  single, multi = metrics.read_metrics(tmp_path / "one"), metrics.read_metrics(tmp_path / "two")
  assert [row["step"] for row in multi] == [row["step"] for row in single] == [1, 2, 3]
  for a, b in zip(single, multi):
    # The same episodes: every row drew its tokens from its own global-row key.
    for key in ("reward", "success", "turns", "tokens_generated"):
      assert a[key] == b[key], key
    for key in ("loss", "grad_norm", "entropy", "policy/ratio_mean", "logprob_gap_mean"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
  # Rewards vary within groups, so the updates move the parameters.
  assert all(0 < row["reward"] < 1 and row["grad_norm"] > 0 for row in single)
  for step in range(1, STEPS + 1):
    conversations = lambda workdir: [(t["task_id"], t["group"], t["messages"]) for t in
                                     metrics.read_trajectories(workdir, step)]
    assert conversations(tmp_path / "two") == conversations(tmp_path / "one")
    assert len(conversations(tmp_path / "two")) == 16

  one_state, two_state = _final_state(tmp_path / "one"), _final_state(tmp_path / "two")
  assert one_state.keys() == two_state.keys()
  for name in one_state:
    np.testing.assert_allclose(two_state[name], one_state[name], rtol=0, atol=1e-5,
                               err_msg=name)
