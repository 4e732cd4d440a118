"""A restructuring changes no behaviour: tests/behaviour_runs.py's four tiny runs (GRPO + KL,
PPO/GAE, SFT, DPO; each resumed once) log byte-identical metrics at the reference commit and at
the working tree, on the same machine.

REFERENCE is the last commit whose behaviour is the reference; a change meant to alter what a
run computes (a fix, a new default) moves it to that change's commit, in the same commit. A
change that only logs more adds its metrics to ADDED: every metric the reference logs must
still be logged byte for byte.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = "b10f4077c545017dba122a1e10171f292a9d364f"
RUNS = ("grpo_kl", "ppo_gae", "sft", "dpo")
# Metrics logged since REFERENCE, with every new key at its default (rollout.EpisodeScoring).
ADDED = {
    "rollout/truncated_fraction", "rollout/excluded_fraction", "rollout/truncated_fraction/horizon",
    "rollout/truncated_fraction/context", "rollout/truncated_fraction/env_timeout",
    "rollout/idle_row_fraction", "context/peak_tokens", "context/rewrites", "context/tokens_saved",
    "rollout/idle_rows/no_episode", "rollout/idle_rows/env_step", "rollout/idle_rows/reply_ended"
}


def _behaviour(tree: pathlib.Path, out: pathlib.Path) -> None:
  """Runs behaviour_runs.py (this checkout's) on the package of `tree`, into `out`."""
  env = {**os.environ, "PYTHONPATH": str(tree)}
  done = subprocess.run(
      [sys.executable, str(REPO / "tests" / "behaviour_runs.py"),
       str(out)], cwd=out.parent, env=env, capture_output=True, text=True, timeout=1800,
      check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"source tree: {tree}" in done.stdout, done.stdout


@pytest.mark.slow
def test_the_tiny_runs_log_the_reference_commits_metrics_byte_for_byte(tmp_path):
  has_reference = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", REFERENCE],
                                 capture_output=True, check=False).returncode == 0
  if not has_reference:
    pytest.skip(f"needs a git checkout holding the reference commit {REFERENCE[:12]}")
  reference = tmp_path / "reference"
  subprocess.run(["git", "-C",
                  str(REPO), "worktree", "add", "--detach",
                  str(reference), REFERENCE], check=True, capture_output=True)
  try:
    _behaviour(reference, tmp_path / "before")
  finally:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "remove", "--force",
         str(reference)], check=False, capture_output=True)
  _behaviour(REPO, tmp_path / "after")
  for name in RUNS:
    before = (tmp_path / "before" / f"{name}.jsonl").read_text()
    after = (tmp_path / "after" / f"{name}.jsonl").read_text()
    assert before.count("\n") == 4, (name, before)
    assert after.count("\n") == 4, (name, after)
    for old_line, new_line in zip(before.splitlines(), after.splitlines()):
      old_row, new_row = json.loads(old_line), json.loads(new_line)
      assert new_row.keys() - old_row.keys() <= ADDED, (name, new_row.keys() - old_row.keys())
      kept = {key: new_row[key] for key in old_row}
      assert json.dumps(kept) == json.dumps(old_row), name
