"""launch/train.py on two processes (JAX distributed runtime, Gloo collectives on CPU), each with
its own env pool and sampler rows, trains as one process does with the same global config."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tolerances
from agentgym_jax import metrics
from environments.http.served import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3

# The parameters of the two runs are compared against an error model. Two processes all-reduce
# each gradient element in another order than one process does, so it differs by a rounding
# error dg of typical size sqrt(n) u scale (tests/tolerances.py), over the n <= 8 rows x 128
# tokens of a minibatch, at the scale of gradients clipped to global norm 1 (every element <= 1):
# GRAD_ROUNDING = SAFETY sqrt(1024) 2^-24 = 1.5e-5. AdamW's update lr m / (sqrt(v) + eps) moves by
# at most lr (1 + C) dg / eps for a change dg of the newest gradient (d m/d g <= 1, and the
# sqrt(v) term adds at most C = max|m / sqrt(v)| <= 3 for these beta), but is not Lipschitz at
# eps -> 0: with the default eps = 1e-8 a gradient element that is itself rounding noise moves its
# parameter by up to lr either way, whatever the machine (2.4e-5 was seen on AVX-512). So the
# runs use ADAM_EPS = 0.1, where the UPDATES = STEPS x 2 minibatches x 2 epochs updates of LR
# bound the parameters' difference by UPDATES LR (1 + C) GRAD_ROUNDING / ADAM_EPS = 2.2e-5
# (second-order terms, gradients at parameters that differ by that, are far smaller).
LR, ADAM_EPS, UPDATES = 3e-3, 0.1, STEPS * 2 * 2
GRAD_ROUNDING = tolerances.reordered_sum(8 * 128)
PARAMETER_TOLERANCE = UPDATES * LR * (1 + 3) * GRAD_ROUNDING / ADAM_EPS

# One-turn echo episodes, which a random policy sometimes gets right; 4 tasks x 4 samples. Each
# process plays 2 tasks on 2 devices, and the mesh's fsdp axis (4 devices) spans both processes,
# so the sampler's copy of the policy is gathered.
SETTINGS = [
    "--config.env.options.turns=1", "--config.horizon.turns=1", "--config.rollout.tasks_per_step=4",
    "--config.rollout.samples_per_task=4", "--config.mesh.fsdp=-1",
    "--config.log.trajectories=True", f"--config.optim.learning_rate={LR}",
    f"--config.optim.eps={ADAM_EPS}"
]
TIMEOUT_S = 300


def _launch(name: str, workdir: pathlib.Path, checkpoint_dir: str, devices: int, *flags:
            str) -> tuple[subprocess.Popen, pathlib.Path]:
  """Starts launch/train.py; returns the process and the file that gets its stderr."""
  command = [
      sys.executable,
      str(REPO / "launch" / "train.py"), f"--config={REPO / 'configs' / 'ablation_echo.py'}:long",
      f"--workdir={workdir}", f"--config.model.name={checkpoint_dir}", *SETTINGS, *flags
  ]
  # PYTHONFAULTHANDLER: a SIGABRT makes the run print every thread's Python stack (see _wait).
  env = {
      **os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
      "PYTHONFAULTHANDLER": "1"
  }
  log = workdir.parent / f"{name}.stderr"
  with open(log, "w") as stderr:
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr), log


def _two_processes(workdir: pathlib.Path, checkpoint_dir: str, *flags:
                   str) -> list[tuple[subprocess.Popen, pathlib.Path]]:
  """launch/train.py as processes 0 and 1 of one run, 2 devices each."""
  port = free_port()
  return [
      _launch(f"{workdir.name}_process_{i}", workdir, checkpoint_dir, 2, *flags,
              f"--coordinator=localhost:{port}", "--num_processes=2", f"--process_id={i}")
      for i in range(2)
  ]


def _wait(runs: list[tuple[subprocess.Popen, pathlib.Path]]) -> None:
  """Waits for every run. One that fails stops them all and fails the test with its stderr; runs
  still going after TIMEOUT_S (a hang in a collective) are aborted, which prints where each
  thread stood, and the test fails with those stacks."""
  deadline = time.monotonic() + TIMEOUT_S
  while any(process.poll() is None for process, _ in runs):
    failed = [log for process, log in runs if process.poll() not in (None, 0)]
    if failed:
      for process, _ in runs:
        process.kill()
      pytest.fail(f"{failed[0].stem} failed:\n{failed[0].read_text()[-3000:]}")
    if time.monotonic() > deadline:
      hung = [(process, log) for process, log in runs if process.poll() is None]
      for process, _ in hung:
        process.send_signal(signal.SIGABRT)
      for process, _ in hung:
        try:
          process.wait(timeout=30)
        except subprocess.TimeoutExpired:
          process.kill()
      stacks = "\n".join(f"{log.stem}:\n{log.read_text()[-8000:]}" for _, log in hung)
      pytest.fail(f"still running after {TIMEOUT_S} s:\n{stacks}")
    time.sleep(0.5)
  for process, log in runs:
    assert process.returncode == 0, f"{log.stem} failed:\n{log.read_text()[-3000:]}"


def _final_state(workdir: pathlib.Path) -> dict[str, np.ndarray]:
  """The step-STEPS checkpoint's arrays by path, read onto this process's one device."""
  path = workdir / "checkpoints" / str(STEPS) / "state"
  with ocp.StandardCheckpointer() as checkpointer:
    stored = checkpointer.metadata(path).item_metadata.tree
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), stored)
    state = checkpointer.restore(path, target)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def _assert_same_parameters(workdir: pathlib.Path, reference: pathlib.Path) -> None:
  state, expected = _final_state(workdir), _final_state(reference)
  assert state.keys() == expected.keys()
  for name in expected:
    np.testing.assert_allclose(state[name], expected[name], rtol=0, atol=PARAMETER_TOLERANCE,
                               err_msg=name)


@pytest.mark.slow
def test_two_processes_train_as_one_process(checkpoint_dir, tmp_path):
  flags = [f"--config.steps={STEPS}", f"--config.checkpoint.every={STEPS}"]
  _wait(
      _two_processes(tmp_path / "two", checkpoint_dir, *flags) +
      [_launch("one", tmp_path / "one", checkpoint_dir, 4, *flags)])

  single, multi = metrics.read_metrics(tmp_path / "one"), metrics.read_metrics(tmp_path / "two")
  assert [row["step"] for row in multi] == [row["step"] for row in single] == [1, 2, 3]
  for a, b in zip(single, multi):
    # The same episodes: every row drew its tokens from its own global-row key.
    for key in ("reward", "success", "turns", "tokens_generated"):
      assert a[key] == b[key], key
    # Means and norms over a minibatch's tokens or the gradient: the reordering error model's
    # relative size.
    for key in ("loss", "grad_norm", "entropy", "policy/ratio_mean"):
      np.testing.assert_allclose(b[key], a[key], rtol=GRAD_ROUNDING, atol=1e-7, err_msg=key)
    # The sampler's and the learner's log-probs differ by rounding alone (their attention sums
    # in another order), so the gap is noise on both sides: below the reordering bound of the
    # tiny model's log-probs (2 layers, dots of up to 128 terms, logits under 10).
    noise = tolerances.reordered_logprobs(2, 128, 10.0)
    assert a["logprob_gap_mean"] < noise and b["logprob_gap_mean"] < noise
  # Rewards vary within groups, so the updates move the parameters.
  assert all(0 < row["reward"] < 1 and row["grad_norm"] > 0 for row in single)
  for step in range(1, STEPS + 1):
    two, one = ([(t["task_id"], t["group"], t["messages"])
                 for t in metrics.read_trajectories(workdir, step)]
                for workdir in (tmp_path / "two", tmp_path / "one"))
    assert two == one and len(two) == 16

  _assert_same_parameters(tmp_path / "two", tmp_path / "one")


@pytest.mark.slow
def test_two_processes_resume_from_their_checkpoint_and_export(checkpoint_dir, tmp_path):
  # Both processes write every step's checkpoint (Orbax, each its own shards); the run stops
  # after step 2, is resumed to step 3, and ends where an uninterrupted 1-process run does.
  flags = ["--config.checkpoint.every=1", "--config.checkpoint.export_hf=True"]
  _wait(
      _two_processes(tmp_path / "two", checkpoint_dir, "--config.steps=2", *flags) +
      [_launch("one", tmp_path / "one", checkpoint_dir, 4, f"--config.steps={STEPS}", *flags)])
  _wait(_two_processes(tmp_path / "two", checkpoint_dir, f"--config.steps={STEPS}", *flags))

  resumed, straight = metrics.read_metrics(tmp_path / "two"), metrics.read_metrics(tmp_path / "one")
  assert [row["step"] for row in resumed] == [1, 2, 3]
  np.testing.assert_allclose(resumed[-1]["grad_norm"], straight[-1]["grad_norm"], rtol=1e-5)
  _assert_same_parameters(tmp_path / "two", tmp_path / "one")
  assert sorted(p.name for p in (tmp_path / "two" / "export").iterdir()) == sorted(
      p.name for p in (tmp_path / "one" / "export").iterdir())


def test_cloud_tpu_vm_joins_through_jax_detection_with_nothing_set(monkeypatch):
  """On a Cloud TPU VM (as JAX found at import) jax.distributed.initialize() runs with no
  arguments, so JAX's metadata-server detection finds the pod; elsewhere nothing runs unless
  a coordinator is given, and a given one wins."""
  from jax._src import cloud_tpu_init

  from agentgym_jax import sharding
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
               "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False)
  sharding.initialize_distributed()
  assert calls == []
  monkeypatch.setattr(cloud_tpu_init, "running_in_cloud_tpu_vm", True)
  sharding.initialize_distributed()
  assert calls == [{}]
  sharding.initialize_distributed("host0:8476", 4, 3)
  assert calls[-1] == {"coordinator_address": "host0:8476", "num_processes": 4, "process_id": 3}
