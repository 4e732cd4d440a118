"""Test set-up: 8 virtual CPU devices so sharding is tested on a (data, fsdp, tensor) mesh, and
each test's stage evaluations cached in its own tmp_path instead of the user's cache.

Every XLA:CPU executable a process keeps loaded holds about three memory maps of JIT code, and
jit's caches keep the executables of module-level functions for the life of the process. The
whole suite compiles enough of them to exhaust Linux's default limit of 65,530 maps a process
(vm.max_map_count), at which point the next compilation crashes the run with a segmentation
fault; so the executables are released after each test file (`jax.clear_caches`). The suite
also keeps no persistent compilation cache (JAX_COMPILATION_CACHE_DIR): it saves little when
each file compiles its own programs, and it adds serialized copies of every executable.
"""

import gc
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


@pytest.fixture(autouse=True, scope="module")
def release_executables():
  """Frees the XLA executables a test file compiled once it ends (see the module docstring)."""
  yield
  import jax  # pylint: disable=import-outside-toplevel

  jax.clear_caches()
  gc.collect()


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
