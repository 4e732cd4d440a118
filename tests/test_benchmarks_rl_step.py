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


@pytest.mark.slow
def test_the_rollout_modes_run_side_by_side_with_slow_env_steps(tmp_path):
  completed = subprocess.run([
      sys.executable,
      str(REPO / "benchmarks" / "rl_step.py"), "--env=echo", "--model=tiny",
      "--mode=sync,stream,async,stream:2", "--step_latency_s=0.05", "--steps=2", "--tasks=2",
      "--samples=2", "--turns=3", "--max_new_tokens=4", "--max_context=128", "--dtype=float32"
  ], cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "XLA_FLAGS": ""})
  assert completed.returncode == 0, completed.stderr[-3000:]
  out = completed.stdout
  modes = ["sync", "stream", "async", "stream:2"]
  assert re.findall(
      r"^mode ([\w:]+): .* with 0.05 s mean step latency, 2 tasks x 2 samples on 2 "
      r"rows", out, re.MULTILINE) == modes, out
  rows = [
      line.strip("| ").split(" | ") for line in out.splitlines()
      if re.match(r"^\| (?:sync|stream|async)(?::2)? \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", line)
  ]
  assert [row[0] for row in rows] == modes, out
  assert rows[0][3] == rows[0][5] == "1.00x" and all(float(row[2]) > 0 for row in rows), out
  # Turns a minute: episodes a minute times turns an episode (the last column), and its ratio
  # to the first mode's. Error model: each printed figure is off by up to half its last digit
  # (0.05 a minute, 0.005 turns, 0.005 in a ratio), and those errors add up through the
  # product and the quotient.
  first = float(rows[0][4])
  for mode, _, episodes, _, turns_per_min, ratio, *_, turns in rows:
    episodes, turns_per_min, turns, ratio = map(float, (episodes, turns_per_min, turns, ratio[:-1]))
    assert abs(turns_per_min - episodes * turns) <= 0.05 * turns + 0.005 * episodes + 0.05, mode
    quotient = turns_per_min / first
    assert abs(ratio - quotient) <= 0.005 + quotient * (0.05 / turns_per_min + 0.05 / first), mode
  # Every env step slept: the env time of a mode's steps is at least a drawn 0.05 s mean.
  assert all(float(row[8]) > 0 for row in rows), out


def _worktrees() -> set[str]:
  listing = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout
  return {line for line in listing.splitlines() if line.startswith("worktree ")}
