"""Training curves of a run as PNG images (matplotlib), from its metrics.jsonl.

`write_plots(workdir, out_dir)` draws one panel per quantity in PANELS that the run logged,
all together in training_curves.png and each alone in <panel>.png. A key absent from every row
leaves its panel out; a key absent or null in some rows leaves gaps in no other curve
(each curve keeps only the rows where it is a finite number). Evaluation keys, logged only at
evaluation steps, are drawn with markers; per-category evaluation success (eval/success/<c>)
shares the success panel.

Noisy curves are drawn raw (faint) and smoothed with a debiased exponential moving average
(TensorBoard's smoothing), see `smooth`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax import metrics
from environments import jsonl

OVERVIEW_FILE = "training_curves.png"
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
  """Draws the curves of the run in `workdir`; returns the written PNG paths, overview first.

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
  return paths
