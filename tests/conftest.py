"""Test set-up: 8 virtual CPU devices so sharding is tested on a (data, fsdp, tensor) mesh, a
persistent compilation cache shared by the test processes (and their subprocesses), and each
test's stage evaluations cached in its own tmp_path instead of the user's cache."""

import hashlib
import importlib.metadata
import os
import pathlib
import platform

import pytest


def host_signature() -> str:
  """What an XLA:CPU executable is compiled for and read back by: the CPU's model and
  instruction-set flags, and the jaxlib that compiled it. JAX's own cache key names the
  platform ("cpu") but not the CPU, so an executable compiled with AMX or AVX512-BF16
  instructions would be loaded, and crash, on a CPU without them if machines shared a cache."""
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      lines = f.read().split("\n\n")[0].splitlines()
    cpu = "\n".join(line for line in lines if line.startswith(("model name", "flags")))
  except OSError:
    pass
  jaxlib = importlib.metadata.version("jaxlib")
  return hashlib.sha256(f"{cpu}\njaxlib {jaxlib}".encode()).hexdigest()[:16]


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(pathlib.Path.home() / ".cache" / "agentgym_jax" / "jax_test_cache" / host_signature()))


@pytest.fixture(autouse=True)
def evaluation_cache(tmp_path, monkeypatch):
  """The default eval.cache_dir of the configs a test builds: its own, in tmp_path (a test
  that plays the same evaluation as another still plays it, and the user's cache stays as it
  was)."""
  from agentgym_jax import config  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(config, "EVALUATION_CACHE_DIR", str(tmp_path / "evaluation_cache"))


@pytest.fixture
def single_device(monkeypatch):
  """Runs on one device, as on a workstation (tests/tiny.py's `one_device`)."""
  import tiny  # pylint: disable=import-outside-toplevel

  tiny.one_device(monkeypatch)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
  """tests/tiny.py's random model saved as a Hugging Face checkpoint (read, never written)."""
  import tiny  # pylint: disable=import-outside-toplevel

  return str(tiny.make_checkpoint(tmp_path_factory.mktemp("tiny")))
