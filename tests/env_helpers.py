"""Helpers shared by the environments' tests: module-scoped adapters, ReAct replies, and Python
subprocesses run from the repository (to check what must not depend on the process), and a pool
surface of categorised train tasks for curricula."""

import os
import subprocess
import sys

import pytest

from environments import base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_fixture(factory, **options):
  """A module-scoped fixture: the environment `factory(**options)`, or base.make(factory,
  **options) for a registered name, closed after the module."""

  @pytest.fixture(scope="module")
  def fixture():
    env = base.make(factory, **options) if isinstance(factory, str) else factory(**options)
    yield env
    env.close()

  return fixture


def react_reply(action: str) -> str:
  """A ReAct reply whose action is `action`."""
  return f"Thought: I know what to do.\n\nAction: {action}"


def run_python(*args: str, hash_seed: str | None = None, **options) -> str:
  """The stdout of `python *args` run in the repository, with PYTHONHASHSEED=`hash_seed` if given;
  `options` go to subprocess.run."""
  env = None if hash_seed is None else {**os.environ, "PYTHONHASHSEED": hash_seed}
  return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        check=True, **options).stdout


class CategorisedTasks:
  """The pool surface a curriculum reads: train task ids and each task's category."""

  def __init__(self, categories):
    self.categories = categories

  def task_ids(self, split):
    assert split == "train"
    return list(self.categories)

  def task_info(self, task_id):
    return {"category": self.categories[task_id]}
