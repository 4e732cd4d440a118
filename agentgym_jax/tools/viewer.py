"""A self-contained HTML page for reading what the agents of a run did.

`write_viewer(workdir, out)` reads a run's metrics.jsonl and trajectories/ (the formats of
agentgym_jax/metrics.py) and writes one HTML file with its CSS, JavaScript and data inline (the
page, its style and its script are viewer.html, viewer.css and viewer.js beside this file), so
it opens offline from file:// and can be mailed or archived with the run:

  * charts of success, reward, turns, horizon cap and evaluation success over the steps
    (clicking a chart filters the list to the nearest step with logged trajectories);
  * the trajectories, filtered by step, task id, environment, task category, outcome and
    termination, and by free text over the messages, in pages of 50 rows, sortable by column;
    the Sample and Adv. columns appear only when some record has them (an RL step's records
    do; evaluation records, launch/evaluate.py --trajectories, have neither);
  * one trajectory's whole conversation: the instruction and first observation, each turn's
    thought, action and reward, the observations between turns, the advantage, how the
    episode ended and the environment's error.

Safety. The run's text is data, never markup: it travels as JSON inside
<script type="application/json"> with "<", ">" and "&" written as \\u escapes (so a message
containing "</script>" cannot end the tag), and the page builds every element with
textContent, never innerHTML.
"""

from __future__ import annotations

import datetime
import html
import importlib.resources
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agentgym_jax import metrics
from agentgym_jax.tools import plots
from environments import jsonl

# (title, metric keys or key prefixes ending in "/", drawn as a step function).
CHARTS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("Success rate", ("success",), False),
    ("Reward", ("reward",), False),
    ("Turns", ("turns",), False),
    ("Horizon cap", ("horizon_cap",), True),
    ("Evaluation success", ("eval/success", "eval/success/"), False),
)
# Chart keys that can be recomputed from the trajectories of a step when metrics.jsonl lacks
# them (a run whose metrics file was lost, or a foreign run with only trajectories).
_FROM_TRAJECTORIES = {"success": "success", "reward": "reward", "turns": "num_turns"}
# The list's columns: (trajectory field, header), in order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("step", "Step"),
    ("task_id", "Task"),
    ("sample", "Sample"),
    ("env", "Env"),
    ("category", "Category"),
    ("success", "Outcome"),
    ("reward", "Reward"),
    ("advantage", "Adv."),
    ("num_turns", "Turns"),
    ("termination", "Ended by"),
    ("num_tokens", "Tokens"),
)
# Columns shown only when some trajectory has a value for them: the trainer's records carry a
# sample index and an advantage, evaluation records neither.
OPTIONAL_COLUMNS = frozenset({"sample", "advantage"})
_SLOT = re.compile(r"__(TITLE|CSS|JS|DATA)__")


def _int_or(value: Any, default: int) -> int:
  number = jsonl.finite(value)
  return default if number is None else int(number)


def chart_series(rows: Sequence[Mapping[str, Any]],
                 trajectories: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The charts of the page: [{"title", "step_function", "series": [{"name", "points"}]}].

  A chart keeps the series that have points; a chart without any is left out. Success, reward
  and turns missing from metrics.jsonl are averaged from the trajectories of each step.
  """
  by_step: dict[int, list[Mapping[str, Any]]] = {}
  for trajectory in trajectories:
    by_step.setdefault(trajectory["step"], []).append(trajectory)
  charts = []
  for title, keys, step_function in CHARTS:
    series = []
    for name in plots.matching_keys(rows, keys):
      points = [list(point) for point in zip(*plots.metric_series(rows, name))]
      if not points and name in _FROM_TRAJECTORIES:
        field = _FROM_TRAJECTORIES[name]
        points = [[step, sum(float(t[field] or 0) for t in group) / len(group)]
                  for step, group in sorted(by_step.items())]
      if points:
        series.append({"name": name, "points": points})
    if series:
      charts.append({"title": title, "step_function": step_function, "series": series})
  return charts


def columns(trajectories: Sequence[Mapping[str, Any]]) -> list[list[str]]:
  """[field, header] of the list's columns for these trajectories (views): every column of
  COLUMNS but the optional ones that no trajectory has a value for."""
  return [[field, header] for field, header in COLUMNS
          if field not in OPTIONAL_COLUMNS or any(t[field] is not None for t in trajectories)]


def _trajectory_view(record: Mapping[str, Any], step: int) -> dict[str, Any]:
  """A logged trajectory with every field the page reads, defaults for missing ones."""
  info = record.get("info") if isinstance(record.get("info"), Mapping) else {}
  messages = [{"role": str(m.get("role", "")), "content": str(m.get("content", ""))}
              for m in record.get("messages") or () if isinstance(m, Mapping)]
  turn_rewards = [jsonl.finite(r) for r in record.get("turn_rewards") or ()]
  reward = jsonl.finite(record.get("reward"))
  return {
      "step": int(record.get("step", step)),
      "task_id": record.get("task_id"),
      "group": record.get("group"),
      "sample": record.get("sample"),
      "env": str(record.get("env") or info.get("env") or ""),
      "category": str(record.get("category") or info.get("category") or ""),
      "reward": reward if reward is not None else sum(r or 0.0 for r in turn_rewards),
      "success": bool(record.get("success", info.get("success", False))),
      "num_turns": _int_or(record.get("num_turns"), len(turn_rewards)),
      "termination": str(record.get("termination") or ""),
      "error": str(record.get("error") or ""),
      "advantage": jsonl.finite(record.get("advantage")),
      "turn_rewards": turn_rewards,
      "num_tokens": record.get("num_tokens"),
      "num_trained_tokens": record.get("num_trained_tokens"),
      "messages": messages,
      "info": jsonl.json_safe(info),
  }


def load_run(workdir: str | os.PathLike[str], max_steps: int = 0) -> dict[str, Any]:
  """The page's data for the run in `workdir`.

  Args:
    workdir: a run directory with metrics.jsonl and/or trajectories/.
    max_steps: keep the trajectories of only the last `max_steps` logged steps (0: all), which
      bounds the size of the page for long runs; the charts always cover every step.
  """
  workdir = os.fspath(workdir)
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"Run directory {workdir!r} does not exist.")
  if max_steps < 0:
    raise ValueError(f"max_steps must be >= 0 (0 keeps every step), got {max_steps}.")
  rows = metrics.read_metrics(workdir)
  logged_steps = metrics.trajectory_steps(workdir)
  if not rows and not logged_steps:
    raise ValueError(f"{workdir!r} has neither {metrics.METRICS_FILE} nor trajectory files "
                     f"under {metrics.TRAJECTORY_DIR}/: is it a run directory?")
  shown_steps = logged_steps[-max_steps:] if max_steps else logged_steps
  trajectories = [
      _trajectory_view(record, step) for step in shown_steps
      for record in metrics.read_trajectories(workdir, step)
  ]
  return {
      "title": os.path.basename(os.path.abspath(workdir)),
      "workdir": os.path.abspath(workdir),
      "generated": datetime.datetime.now().isoformat(timespec="seconds"),
      "num_metric_rows": len(rows),
      "logged_steps": logged_steps,
      "shown_steps": shown_steps,
      "charts": jsonl.json_safe(chart_series(rows, trajectories)),
      "columns": columns(trajectories),
      "trajectories": trajectories,
  }


def embed_json(value: Any) -> str:
  """JSON for a <script type="application/json"> element.

  "<", ">" and "&" occur in JSON only inside strings, where \\u escapes mean the same
  characters to JSON.parse; escaping them means no "</script>" or "<!--" in the text.
  """
  text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
  return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(run: Mapping[str, Any]) -> str:
  """The whole page for `run` (from `load_run`)."""
  fills = {
      "TITLE": html.escape(f"{run['title']} · agentgym-jax"), "CSS": _asset("viewer.css"),
      "JS": _asset("viewer.js"), "DATA": embed_json(run)
  }
  # One pass, so a slot name inside the run's text is never filled in turn.
  return _SLOT.sub(lambda match: fills[match.group(1)], _asset("viewer.html"))


def _asset(name: str) -> str:
  return importlib.resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def page(workdir: str | os.PathLike[str], max_steps: int = 0) -> str:
  """The page for the run in `workdir` (load_run's `max_steps`)."""
  return render_html(load_run(workdir, max_steps=max_steps))


def write_viewer(workdir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 max_steps: int = 0) -> str:
  """Writes the page for the run in `workdir` to `out` (default workdir/viewer.html)."""
  out = os.fspath(out) if out else os.path.join(os.fspath(workdir), "viewer.html")
  page_text = page(workdir, max_steps=max_steps)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    f.write(page_text)
  return out
