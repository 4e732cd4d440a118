"""Training-curve images: metric series extraction, smoothing, and the PNGs written."""

import json
import os
import struct
import subprocess
import sys

import pytest

from agentgym_jax.tools import plots
from fake_run import write_fake_run

_PANEL_PIXELS = (600, 360)  # plots.PANEL_SIZE inches x plots.DPI.


def _png_size(path: str) -> tuple[int, int]:
  """(width, height) from a PNG's IHDR chunk, which follows the 8-byte signature."""
  with open(path, "rb") as f:
    header = f.read(24)
  assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
  assert header[12:16] == b"IHDR"
  return struct.unpack(">II", header[16:24])


def _write_metrics(workdir, rows) -> str:
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  return str(workdir)


def test_smooth_is_debiased_ema_worked_example():
  # weight 0.5 over [1, 3]: m1 = 0.5 * 1 = 0.5, s1 = 0.5 / (1 - 0.5) = 1;
  # m2 = 0.5 * 0.5 + 0.5 * 3 = 1.75, s2 = 1.75 / (1 - 0.25) = 7/3.
  assert plots.smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, 7.0 / 3.0])
  # Debiasing keeps a constant series constant (a plain EMA from 0 would start at 0.1 * 4).
  assert plots.smooth([4.0] * 5, 0.9) == pytest.approx([4.0] * 5)
  assert plots.smooth([1.0, -2.0, 5.0], 0.0) == [1.0, -2.0, 5.0]


def test_smooth_rejects_weights_outside_unit_interval():
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    plots.smooth([1.0], 1.0)


def test_metric_series_skips_missing_and_null_and_keeps_last_repeat_of_a_step():
  rows = [{"step": 0, "kl": 0.1}, {"step": 1}, {"step": 2, "kl": None}, {"step": 3, "kl": 0.5},
          {"step": 3, "kl": 0.7}, {"step": 4, "kl": True}]
  assert plots.metric_series(rows, "kl") == ([0, 3], [0.1, 0.7])
  assert plots.metric_series(rows, "absent") == ([], [])


def test_matching_keys_takes_exact_names_then_prefixes_without_repeats():
  rows = [{
      "step": 0, "time": 1.0, "time/update": 2.0, "time/rollout": 3.0, "eval/success": 1,
      "eval/success/b": 0, "eval/success/a": 1
  }]
  assert plots.matching_keys(rows, ("time/",)) == ["time/rollout", "time/update"]
  assert plots.matching_keys(rows, ("eval/success", "eval/success/")) == [
      "eval/success", "eval/success/a", "eval/success/b"
  ]


def test_write_plots_draws_every_logged_panel(tmp_path):
  workdir = write_fake_run(tmp_path / "run")
  paths = plots.write_plots(workdir, tmp_path / "plots")
  names = [os.path.basename(path) for path in paths]
  # The fake run logs a key of every panel.
  assert names == [plots.OVERVIEW_FILE] + [f"{panel.name}.png" for panel in plots.PANELS]
  for path in paths[1:]:
    assert _png_size(path) == _PANEL_PIXELS
    assert os.path.getsize(path) > 5_000, f"{path} looks blank"
  # 13 panels in 3 columns -> 5 rows of 600 x 360 pixels.
  assert _png_size(paths[0]) == (3 * 600, 5 * 360)


def test_missing_keys_leave_their_panels_out(tmp_path):
  rows = [{"step": s, "reward": 0.1 * s, "success": None if s == 3 else 0.5} for s in range(12)]
  rows[4]["horizon_cap"] = 5
  paths = plots.write_plots(_write_metrics(tmp_path, rows), smoothing=0.9)
  assert [os.path.basename(p) for p in paths
         ] == [plots.OVERVIEW_FILE, "reward.png", "success.png", "horizon_cap.png"]
  assert os.path.dirname(paths[0]) == os.path.join(tmp_path, "plots")
  assert _png_size(paths[0]) == (3 * 600, 360)


def test_write_plots_explains_unusable_runs(tmp_path):
  with pytest.raises(ValueError, match="missing or empty"):
    plots.write_plots(tmp_path)
  with pytest.raises(ValueError, match="none of the plotted metrics"):
    plots.write_plots(_write_metrics(tmp_path, [{"step": 0, "custom": 1.0}]))
  with pytest.raises(ValueError, match="smoothing"):
    plots.write_plots(_write_metrics(tmp_path, [{"step": 0, "reward": 1.0}]), smoothing=-0.1)


def test_plot_command_line(tmp_path):
  workdir = _write_metrics(tmp_path / "run", [{"step": s, "reward": s} for s in range(3)])
  out_dir = tmp_path / "images"
  result = subprocess.run(
      [sys.executable, "launch/plot.py", f"--workdir={workdir}", f"--out_dir={out_dir}"],
      cwd=os.path.join(os.path.dirname(__file__), ".."), capture_output=True, text=True, check=True)
  assert result.stdout.split() == [str(out_dir / plots.OVERVIEW_FILE), str(out_dir / "reward.png")]
  assert _png_size(out_dir / "reward.png") == _PANEL_PIXELS


def test_moving_average_is_trailing_mean_worked_example():
  # Window 3 over [1, 0, 0, 1, 1]: 1/1, 1/2, 1/3, 1/3, 2/3.
  assert plots.moving_average([1.0, 0.0, 0.0, 1.0, 1.0],
                              3) == pytest.approx([1.0, 0.5, 1 / 3, 1 / 3, 2 / 3])
  assert plots.moving_average([0.2, 0.4], 1) == [0.2, 0.4]
  with pytest.raises(ValueError, match="window"):
    plots.moving_average([1.0], 0)


def _stage(successes: dict[int, tuple[str, float]]) -> dict:
  """A stage summary of tasks {task id: (category, success)} as evaluation.summarize writes it."""
  by_category = {}
  for category, success in successes.values():
    by_category.setdefault(category, []).append(success)
  return {
      "k":
          1, "num_tasks":
              len(successes), "avg@k":
                  sum(s for _, s in successes.values()) / len(successes), "categories": {
                      name: {"num_tasks": len(values), "avg@k": sum(values) / len(values)}
                      for name, values in by_category.items()
                  }, "tasks": [{"task_id": task, "category": category, "success": [success]}
                               for task, (category, success) in successes.items()]
  }


def test_stage_figure_of_a_recipe_workdir(tmp_path):
  rows = [{"step": s, "success": s / 4, "horizon_cap": 3 if s < 3 else 5} for s in range(1, 5)]
  workdir = _write_metrics(tmp_path / "run", rows)
  os.makedirs(tmp_path / "run" / "evaluation")
  tasks = {1: "depth1", 2: "depth1", 3: "depth2", 4: "depth2"}
  stages = {"initial": [0, 0, 0, 0], "warm_start": [1, 1, 0, 0], "rl": [1, 0, 1, 1]}
  for name, outcomes in stages.items():
    summary = _stage({task: (tasks[task], float(s)) for task, s in zip(tasks, outcomes)})
    (tmp_path / "run" / "evaluation" / f"{name}.json").write_text(json.dumps(summary))
  summaries = plots.stage_summaries(workdir)
  assert list(summaries) == ["initial", "warm start", "RL"]
  assert plots.stage_points(summaries) == {
      "depth1": [0.0, 1.0, 0.5], "depth2": [0.0, 0.0, 1.0], "all": [0.0, 0.5, 0.75]
  }
  # initial -> warm start gains tasks 1 and 2 (sign test: 2 of 2, p = 2 * 1/4 = 0.5); warm start
  # -> RL gains 3 and 4 and loses 2 (p = 2 * P(X <= 1 | n = 3) = 2 * 4/8 = 1).
  assert plots.stage_labels(summaries) == [
      "initial", "warm start\n+2 -0, p = 0.5", "RL\n+2 -1, p = 1"
  ]
  paths = plots.write_plots(workdir, tmp_path / "plots")
  assert os.path.basename(paths[-1]) == plots.STAGE_FILE
  assert _png_size(paths[-1]) == (2 * 600, int(1.25 * 360))
  # A plain RL run's workdir has no stage figure.
  assert plots.write_stage_figure(_write_metrics(tmp_path / "plain", rows), tmp_path) is None
