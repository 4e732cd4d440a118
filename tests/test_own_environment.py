"""A user's own environment, as docs/environments.md describes it: the page's example adapter
plays by the protocol, an installed package's entry point makes it a registered name (lazily,
with one clear error when it cannot load), and a step of RL trains on it through agentgym-train
from a temporary site directory."""

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import environments
from environments import base
from environments.echo import EchoEnv
from environments.pool import EnvPool

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "environments.md"


def doc_block(first_line: str) -> str:
  """The fenced code block of docs/environments.md that starts with `first_line`."""
  blocks = re.findall(r"```[a-z]*\n(.*?)```", DOC.read_text(), re.DOTALL)
  (block,) = [b for b in blocks if b.startswith(first_line + "\n")]
  return block


def write_package(directory: pathlib.Path) -> pathlib.Path:
  """The page's package: pyproject.toml with the entry point, my_envs/arithmetic.py."""
  (directory / "my_envs").mkdir(parents=True)
  (directory / "my_envs" / "__init__.py").write_text("")
  (directory / "my_envs" / "arithmetic.py").write_text(doc_block("# my_envs/arithmetic.py"))
  (directory / "pyproject.toml").write_text(doc_block("# pyproject.toml"))
  return directory


def write_dist(site: pathlib.Path, name: str, entry_points: dict[str, str],
               modules: dict[str, str]) -> None:
  """An installed distribution written by hand into `site`: its modules (dotted name ->
  source), METADATA and the agentgym_jax.environments entry points."""
  for module, source in modules.items():
    path = site.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "__init__.py").touch()
    path.write_text(textwrap.dedent(source))
  info = site / f"{name.replace('-', '_')}-1.0.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
  lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
  (info / "entry_points.txt").write_text(f"[{base.ENTRY_POINT_GROUP}]\n{lines}")


@pytest.fixture
def fresh_registry(monkeypatch):
  """The registry as a new process has it (entry points not read yet), restored afterwards
  with sys.modules and sys.path."""
  monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
  monkeypatch.setattr(base, "_entry_points_read", False)
  modules = set(sys.modules)
  yield
  for name in set(sys.modules) - modules:
    if name.startswith(("my_envs", "broken_envs", "shadow_envs")):
      del sys.modules[name]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  """The page's package installed with pip into a temporary site directory."""
  package = write_package(tmp_path_factory.mktemp("package"))
  target = tmp_path_factory.mktemp("site")
  subprocess.run([
      sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
      "--target",
      str(target),
      str(package)
  ], check=True, capture_output=True, timeout=600)
  return target


def test_docs_example_adapter_plays_by_the_protocol(tmp_path, monkeypatch, fresh_registry):
  monkeypatch.syspath_prepend(str(write_package(tmp_path)))
  from my_envs.arithmetic import ArithmeticEnv  # pylint: disable=import-outside-toplevel

  env = ArithmeticEnv(tries=2)
  assert isinstance(env, base.Env)
  train, test = env.task_ids("train"), env.task_ids("test")
  assert len(train) == 1000 and len(test) == 100 and not set(train) & set(test)
  # Task 7: 10 + 259 % 90 = 89 and 10 + 371 % 90 = 21; 9 + 1 carries.
  assert env.reset(7) == "What is 89 + 21?"
  assert env.task_info(7) == {"category": "carry"}
  assert env.task_info(0) == {"category": "no carry"}  # 10 + 10.
  invalid = env.step("Thought: hm.\n\nAction: 110")
  assert (invalid.reward, invalid.done) == (0.0, False)
  wrong = env.step("Action: answer 100")
  assert (wrong.observation, wrong.reward, wrong.done) == ("Wrong. 1 tries left.", 0.0, False)
  right = env.step("Thought: 89 + 21 = 110.\n\nAction: answer 110")
  assert (right.reward, right.done, right.info) == (1.0, True, {"success": True})
  env.reset(7)
  env.step("Action: answer 1")
  last = env.step("Action: answer 2")
  assert (last.reward, last.done, last.info) == (0.0, True, {"success": False})
  # The page's hand-played lines print what their comments say.
  snippet = doc_block("from my_envs.arithmetic import ArithmeticEnv")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(snippet, {})  # pylint: disable=exec-used
  comments = [line.split("# ")[1] for line in snippet.splitlines() if line.startswith("print(")]
  assert printed.getvalue().splitlines() == comments


def test_installed_package_adapter_is_found_by_name_and_imported_when_built(
    site, monkeypatch, fresh_registry):
  monkeypatch.syspath_prepend(str(site))
  assert "arithmetic" in environments.registered()
  assert "my_envs.arithmetic" not in sys.modules  # Listed, not imported.
  env = environments.make("arithmetic", tries=5)
  assert "my_envs.arithmetic" in sys.modules
  assert (env.name, env.tries) == ("arithmetic", 5)
  assert env.reset(0) == "What is 10 + 10?"


def test_an_unknown_name_reads_the_entry_points_first(site, monkeypatch, fresh_registry):
  monkeypatch.syspath_prepend(str(site))
  assert environments.make("arithmetic").reset(1) == "What is 47 + 63?"
  with pytest.raises(ValueError,
                     match=r"unknown environment 'arithmetc'; registered: .*arithmetic"):
    environments.make("arithmetc")


def test_process_pool_slots_build_an_installed_adapter_by_name(site, monkeypatch, fresh_registry):
  # Each slot's adapter lives in a spawned process, which finds the name through the entry
  # point itself.
  monkeypatch.syspath_prepend(str(site))
  with EnvPool("arithmetic", num_slots=2, backend="process") as pool:
    assert [r.observation for r in pool.reset([(0, 0), (1, 1)])
           ] == ["What is 10 + 10?", "What is 47 + 63?"]
    results = pool.step([(0, "Action: answer 20"), (1, "Action: answer 1")])
  assert [(r.reward, r.done) for r in results] == [(1.0, True), (0.0, False)]


def test_an_entry_point_that_cannot_load_fails_with_one_clear_error(tmp_path, monkeypatch,
                                                                    fresh_registry):
  write_dist(tmp_path, "broken-envs",
             {"broken": "broken_envs.adapter:BrokenEnv", "misspelt": "broken_envs.fine:FineEnvv"}, {
                 "broken_envs.adapter": "import numpyy_not_installed\n",
                 "broken_envs.fine": "class FineEnv:\n  pass\n"
             })
  monkeypatch.syspath_prepend(str(tmp_path))
  assert {"broken", "misspelt"} <= set(environments.registered())
  with pytest.raises(base.AdapterImportError) as raised:
    environments.make("broken")
  assert str(raised.value) == (
      "environment 'broken': package broken-envs's entry point 'broken_envs.adapter:BrokenEnv' "
      "(group agentgym_jax.environments) failed to load: ModuleNotFoundError: No module named "
      "'numpyy_not_installed'")
  with pytest.raises(base.AdapterImportError, match=r"'misspelt': .* AttributeError: .*FineEnvv"):
    base.factory("misspelt")


def test_entry_points_never_replace_built_in_or_registered_names(tmp_path, monkeypatch,
                                                                 fresh_registry):
  write_dist(tmp_path, "shadow-envs",
             {"echo": "shadow_envs.adapter:Shadow", "mine": "shadow_envs.adapter:Shadow"},
             {"shadow_envs.adapter": "class Shadow:\n  name = 'shadow'\n"})
  environments.register("mine", EchoEnv)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert isinstance(environments.make("echo"), EchoEnv)
  assert isinstance(environments.make("mine"), EchoEnv)
  assert "shadow_envs.adapter" not in sys.modules


# One RL step of the page's config on the page's adapter, through agentgym-train, in a process
# that has the temporary site on its path (as PYTHONPATH).
_TINY = [
    "--config.model.dtype=float32", "--config.model.remat=none", "--config.mesh.fsdp=1",
    "--config.steps=1", "--config.rollout.tasks_per_step=2", "--config.rollout.samples_per_task=2",
    "--config.rollout.max_new_tokens=4", "--config.rollout.max_context=256",
    "--config.algorithm.num_minibatches=1", "--config.checkpoint.every=0",
    "--config.checkpoint.export_hf=False", "--config.log.tensorboard=False",
    "--config.log.progress_bar=False", "--config.log.trajectories=True"
]


@pytest.mark.slow
def test_agentgym_train_trains_a_step_on_an_installed_environment(site, checkpoint_dir, tmp_path):
  (tmp_path / "my_config.py").write_text(doc_block("# my_config.py"))
  workdir = tmp_path / "run"
  env = {
      **os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "--xla_force_host_platform_device_count=1"
  }
  result = subprocess.run([
      sys.executable, "-c", "from agentgym_jax.commands.train import main; main()",
      "--config=my_config.py:local", f"--workdir={workdir}",
      f"--config.model.name={checkpoint_dir}", *_TINY
  ], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [1]
  assert "loss" in rows[0]
  (log,) = (workdir / "trajectories").glob("step_000001.jsonl")
  trajectories = [json.loads(line) for line in log.read_text().splitlines()]
  assert len(trajectories) == 4
  for trajectory in trajectories:
    assert trajectory["env"] == "arithmetic"
    assert re.search(r"\n\nWhat is \d+ \+ \d+\?$", trajectory["messages"][0]["content"])
    assert trajectory["category"] in ("carry", "no carry")
