"""Training curves of a run as PNG images (matplotlib), from its metrics.jsonl.

`write_plots(workdir, out_dir)` draws one panel per quantity in PANELS that the run logged,
all together in training_curves.png and each alone in <panel>.png. A key absent from every row
leaves its panel out; a key absent or null in some rows leaves gaps in no other curve
(each curve keeps only the rows where it is a finite number). Evaluation keys, logged only at
evaluation steps, are drawn with markers; per-category evaluation success (eval/success/<c>)
shares the success panel.

Noisy curves are drawn raw (faint) and smoothed with a debiased exponential moving average
(TensorBoard's smoothing), see `smooth`.

A recipe's workdir (recipe.py: evaluation/<stage>.json beside the RL run's metrics) also gets
stages.png (`write_stage_figure`): RL training success as a trailing moving average with the
horizon caps, next to each stage's held-out success per category and, between consecutive
stages, the goals gained and lost with the paired test's p-value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax import metrics
from environments import jsonl

OVERVIEW_FILE = "training_curves.png"
STAGE_FILE = "stages.png"
# The recipe's stage evaluations (workdir/evaluation/<stage>.json), in the order it plays them.
RECIPE_STAGES = (("initial", "initial"), ("warm_start", "warm start"), ("rl", "RL"))
PANEL_SIZE = (6.0, 3.6)  # Inches; at DPI this is 600 x 360 pixels per panel image.
DPI = 100
_COLUMNS = 3
_MIN_POINTS_TO_SMOOTH = 10  # Below this every point is visible anyway.
_MAX_POINTS_WITH_MARKERS = 25


@dataclasses.dataclass(frozen=True)
class Panel:
  """One plot: the metric keys it draws (exact, or prefixes ending in "/")."""

  name: str  # File stem of the panel's own image.
  title: str
  keys: tuple[str, ...]
  step_function: bool = False  # Values that hold until the next change (schedules).
  smooth: bool = True


PANELS: tuple[Panel,
              ...] = (Panel("reward", "Reward", ("reward", "eval/reward")),
                      Panel("success", "Success rate",
                            ("success", "eval/success", "eval/success/")),
                      Panel("horizon_cap", "Horizon cap (turns)", ("horizon_cap",),
                            step_function=True,
                            smooth=False), Panel("turns", "Turns per episode", ("turns",)),
                      Panel("kl_to_ref", "KL to the reference policy",
                            ("kl_to_ref",)), Panel("entropy", "Entropy (nats / token)",
                                                   ("entropy",)),
                      Panel("tokens_per_s", "Generated tokens / s", ("tokens_per_s",)),
                      Panel("phase_times", "Time per phase (s)",
                            ("time/",)), Panel("loss", "Loss", ("loss",)),
                      Panel("grad_norm", "Gradient norm", ("grad_norm",)),
                      Panel("clip_fraction", "Clipped fraction", ("policy/clip_fraction",)),
                      Panel("logprob_gap", "Sampler / learner log-prob gap", ("logprob_gap_mean",)),
                      Panel("termination", "Episode endings (fraction)", ("termination/",),
                            smooth=False))


def matching_keys(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
  """The logged metric names selected by `keys`: exact names, then every name under a prefix.

  Exact names come in the order given, names under a prefix sorted; each name once.
  """
  logged = sorted({key for row in rows for key in row})
  names = []
  for key in keys:
    found = [name for name in logged if name.startswith(key)] if key.endswith("/") else [key]
    names.extend(name for name in found if name not in names)
  return names


def metric_series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the rows where `key` is a finite number, in step order.

  A step logged twice (a run resumed from an earlier checkpoint) keeps its last row.
  """
  by_step = {}
  for row in rows:
    step, value = jsonl.finite(row.get("step")), jsonl.finite(row.get(key))
    if step is not None and value is not None:
      by_step[int(step)] = value
  steps = sorted(by_step)
  return steps, [by_step[step] for step in steps]


def smooth(values: Sequence[float], weight: float) -> list[float]:
  """Debiased exponential moving average, as TensorBoard's smoothing slider.

    m_t = weight * m_{t-1} + (1 - weight) * x_t,  m_0 = 0;   s_t = m_t / (1 - weight^t)

  The division removes the pull towards the zero start, so s_1 = x_1.
  """
  if not 0.0 <= weight < 1.0:
    raise ValueError(f"Smoothing weight must be in [0, 1), got {weight}.")
  smoothed, moving = [], 0.0
  for t, value in enumerate(values, start=1):
    moving = weight * moving + (1.0 - weight) * value
    smoothed.append(moving / (1.0 - weight**t))
  return smoothed


def moving_average(values: Sequence[float], window: int) -> list[float]:
  """The trailing mean of `values` over up to `window` points (fewer at the start)."""
  if window < 1:
    raise ValueError(f"window must be at least 1, got {window}.")
  return [
      sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))
  ]


def stage_summaries(workdir: str | os.PathLike[str]) -> dict[str, Mapping[str, Any]]:
  """The recipe's stage evaluations in `workdir` (RECIPE_STAGES that have a summary), by label."""
  found = {}
  for name, label in RECIPE_STAGES:
    path = os.path.join(os.fspath(workdir), "evaluation", f"{name}.json")
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        found[label] = json.load(f)
  return found


def stage_points(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, list[float | None]]:
  """Held-out success (avg@k) of every stage, per category and "all" (None where a stage's
  summary lacks the category)."""
  names = sorted({name for s in summaries.values() for name in s["categories"]})
  points = {
      name: [s["categories"].get(name, {}).get("avg@k") for s in summaries.values()]
      for name in names
  }
  points["all"] = [s["avg@k"] for s in summaries.values()]
  return points


def stage_labels(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """Each stage's name and, from the second on, its paired comparison with the stage before
  (evaluation.compare): "+gained -lost, p = ..." (or no comparison without per-task records)."""
  # Imported here, not at the top: evaluation brings the models and environments, which the
  # HTML viewer (a user of this module's metric helpers) does not need.
  from agentgym_jax import evaluation

  labels, stages = [], list(summaries.items())
  for index, (label, summary) in enumerate(stages):
    if index and "tasks" in summary and "tasks" in stages[index - 1][1]:
      paired = evaluation.compare(stages[index - 1][1], summary)
      label += f"\n+{paired.gained} -{paired.lost}, p = {float(paired.p_value):.2g}"
    labels.append(label)
  return labels


def write_stage_figure(workdir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                       window: int = 3) -> str | None:
  """Draws STAGE_FILE in `out_dir` for the recipe run in `workdir`; returns its path, or None if
  the workdir has no stage evaluations. Left: RL training success per step (dots) and its
  trailing `window`-step mean, the horizon cap on a second axis; right: held-out success per
  stage, one line per category and one for all, the x labels carrying the paired tests."""
  from matplotlib.figure import Figure

  summaries = stage_summaries(workdir)
  if not summaries:
    return None
  rows = metrics.read_metrics(os.fspath(workdir))
  figure = Figure(figsize=(PANEL_SIZE[0] * 2, PANEL_SIZE[1] * 1.25), dpi=DPI, layout="constrained")
  train, held_out = figure.subplots(1, 2)
  steps, success = metric_series(rows, "success")
  if steps:
    train.plot(steps, success, "o", color="C0", alpha=0.35, markersize=4, label="per step")
    train.plot(steps, moving_average(success, window), color="C0", linewidth=2,
               label=f"{window}-step mean")
    cap_steps, caps = metric_series(rows, "horizon_cap")
    if cap_steps:
      turns = train.twinx()
      turns.plot(cap_steps, caps, drawstyle="steps-post", color="C7", linestyle="--")
      turns.set_ylabel("horizon cap (turns, dashed)", fontsize=8)
      turns.set_ylim(0, max(caps) + 1)
      turns.tick_params(labelsize=8)
    train.legend(fontsize=7, loc="upper left")
  train.set_ylim(-0.05, 1.05)
  train.set_title("RL training success", fontsize=10)
  train.set_xlabel("RL step", fontsize=8)
  train.tick_params(labelsize=8)
  train.grid(alpha=0.3)
  positions = list(range(len(summaries)))
  for index, (name, values) in enumerate(stage_points(summaries).items()):
    shown = [(x, 100 * v) for x, v in zip(positions, values) if v is not None]
    style = dict(color="k", linewidth=2.2) if name == "all" else dict(color=f"C{index + 1}")
    tasks = next(s["num_tasks"] if name == "all" else s["categories"][name]["num_tasks"]
                 for s, v in zip(summaries.values(), values) if v is not None)
    held_out.plot(*zip(*shown), marker="o", label=f"{name} ({tasks})", **style)
    if name == "all":
      for x, y in shown:
        held_out.annotate(f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, 7),
                          ha="center", fontsize=8)
  held_out.set_xticks(positions, stage_labels(summaries), fontsize=8)
  held_out.set_ylim(-5, 105)
  k = next(iter(summaries.values()))["k"]
  held_out.set_title(f"Held-out success (avg@{k}) of each stage's policy", fontsize=10)
  held_out.tick_params(axis="y", labelsize=8)
  held_out.grid(alpha=0.3)
  held_out.legend(fontsize=7, loc="upper left")
  path = os.path.join(os.fspath(out_dir), STAGE_FILE)
  figure.savefig(path)
  return path


def _draw(axes: Any, rows: Sequence[Mapping[str, Any]], panel: Panel, names: Sequence[str],
          smoothing: float) -> None:
  for index, name in enumerate(names):
    steps, values = metric_series(rows, name)
    color = f"C{index % 10}"
    marker = "o" if len(steps) <= _MAX_POINTS_WITH_MARKERS else None
    if panel.step_function:
      axes.plot(steps, values, drawstyle="steps-post", color=color, label=name)
      axes.yaxis.get_major_locator().set_params(integer=True)  # Schedules hold whole numbers.
    elif panel.smooth and smoothing > 0 and len(steps) >= _MIN_POINTS_TO_SMOOTH:
      axes.plot(steps, values, color=color, alpha=0.3, linewidth=1)
      axes.plot(steps, smooth(values, smoothing), color=color, linewidth=1.8, label=name)
    else:
      axes.plot(steps, values, color=color, marker=marker, markersize=3, linewidth=1.5, label=name)
  axes.set_title(panel.title, fontsize=10)
  axes.set_xlabel("step", fontsize=8)
  axes.tick_params(labelsize=8)
  axes.grid(alpha=0.3)
  if len(names) > 1:
    axes.legend(fontsize=7, loc="best")


def write_plots(workdir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None,
                smoothing: float = 0.6) -> list[str]:
  """Draws the curves of the run in `workdir`; returns the written PNG paths, overview first
  (and STAGE_FILE last, for a recipe's workdir).

  Args:
    workdir: the run directory (its metrics.jsonl).
    out_dir: where the images go (default workdir/plots).
    smoothing: EMA weight in [0, 1) for noisy curves with >= 10 points; 0 draws them raw.
  """
  # matplotlib is imported here, not at the top: the metric helpers above serve the HTML
  # viewer too, which must not need it. Figure without pyplot: no GUI backend, no global state.
  from matplotlib.figure import Figure

  workdir = os.fspath(workdir)
  if not 0.0 <= smoothing < 1.0:
    raise ValueError(f"smoothing must be in [0, 1), got {smoothing}.")
  rows = metrics.read_metrics(workdir)
  if not rows:
    raise ValueError(f"No metrics to plot: {os.path.join(workdir, metrics.METRICS_FILE)} is "
                     "missing or empty.")
  drawn = [(panel, names) for panel in PANELS if (
      names := [name for name in matching_keys(rows, panel.keys) if metric_series(rows, name)[0]])]
  if not drawn:
    raise ValueError(f"{workdir}/{metrics.METRICS_FILE} has none of the plotted metrics "
                     f"{[key for panel in PANELS for key in panel.keys]}.")
  out_dir = os.fspath(out_dir) if out_dir else os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)

  num_rows = math.ceil(len(drawn) / _COLUMNS)
  overview = Figure(figsize=(PANEL_SIZE[0] * _COLUMNS, PANEL_SIZE[1] * num_rows), dpi=DPI,
                    layout="constrained")
  overview.suptitle(os.path.basename(os.path.abspath(workdir)))
  grid = overview.subplots(num_rows, _COLUMNS, squeeze=False).flatten()
  for axes in grid[len(drawn):]:
    axes.set_visible(False)
  paths = [os.path.join(out_dir, OVERVIEW_FILE)]
  for axes, (panel, names) in zip(grid, drawn):
    _draw(axes, rows, panel, names, smoothing)
    figure = Figure(figsize=PANEL_SIZE, dpi=DPI, layout="constrained")
    _draw(figure.add_subplot(), rows, panel, names, smoothing)
    paths.append(os.path.join(out_dir, f"{panel.name}.png"))
    figure.savefig(paths[-1])
  overview.savefig(paths[0])
  stages = write_stage_figure(workdir, out_dir)
  return paths + ([stages] if stages else [])
