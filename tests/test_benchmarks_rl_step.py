"""benchmarks/rl_step.py --vs runs a recipe in this tree and in a worktree of a commit."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import tiny

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_commit_and_this_tree_run_the_same_recipe_side_by_side(tmp_path):
  checkpoint = tiny.make_checkpoint(tmp_path / "tiny")
  worktrees_before = _worktrees()
  completed = subprocess.run([
      sys.executable,
      str(REPO / "benchmarks" / "rl_step.py"), "--vs=HEAD",
      "--recipe=configs/ablation_echo.py:long", "--steps=2", "--tasks=2", "--samples=2",
      "--turns=2", f"--set=model.name={checkpoint}"
  ], cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "XLA_FLAGS": ""})
  assert completed.returncode == 0, completed.stderr[-3000:]
  out = completed.stdout
  # Both sides ran the recipe (this tree and the commit) and printed their phase tables.
  sides = re.findall(r"^(this tree \(\w+\)|commit HEAD): model\.dtype float32", out, re.MULTILINE)
  assert sides == [sides[0], "commit HEAD"] and sides[0].startswith("this tree"), out
  assert len(re.findall(r"^\| mean \|", out, re.MULTILINE)) == 2, out
  speedups = dict(
      re.findall(r"^\| (step|rollout|update) \| [\d.]+ \| [\d.]+ \| ([\d.]+)x \|", out,
                 re.MULTILINE))
  assert set(speedups) == {"step", "rollout", "update"}, out
  assert all(float(x) > 0 for x in speedups.values()), out
  assert _worktrees() == worktrees_before, "the commit's worktree is removed"


def _worktrees() -> set[str]:
  listing = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout
  return {line for line in listing.splitlines() if line.startswith("worktree ")}
