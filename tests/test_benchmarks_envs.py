"""benchmarks/envs.py runs end to end: its --quick table on TextCraft, every mode, same episodes."""

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_quick_run_measures_every_mode_of_textcraft_on_the_same_episodes():
  completed = subprocess.run(
      [sys.executable,
       str(REPO / "benchmarks" / "envs.py"), "--quick", "--envs=textcraft"], cwd=REPO,
      capture_output=True, text=True, timeout=120)
  assert completed.returncode == 0, completed.stderr
  row = r"^\| textcraft \| (\S+) \| (\d+) \| (\d+) \| (\d+) \| ([\d,.]+) \| ([\d.]+) \|"
  rows = re.findall(row, completed.stdout, re.MULTILINE)
  modes = [mode for mode, *_ in rows]
  # TextCraft is GIL-bound, so the process backend is measured too.
  assert modes == ["in-process", "pool/thread", "pool/process", "http"], completed.stdout
  slots = [int(row[1]) for row in rows]
  assert slots == [1, 4, 4, 4]  # --quick caps the pools at 4 slots
  # Every mode plays the 8 quick episodes with the oracle's plan, so the same steps; each
  # episode takes at least one step (a craft), and at most the quick cap of 5.
  episodes = {int(row[2]) for row in rows}
  steps = {int(row[3]) for row in rows}
  assert episodes == {8} and len(steps) == 1 and 8 <= steps.pop() <= 8 * 5
  steps_per_s = [float(row[4].replace(",", "")) for row in rows]
  assert all(rate > 0 for rate in steps_per_s)
  assert float(rows[0][5]) == 1.0  # the in-process row is its own reference
  assert "env faults" not in completed.stdout
  assert "Machine: " in completed.stdout and "--quick --envs=textcraft" in completed.stdout
