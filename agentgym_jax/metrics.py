"""Metrics and trajectory logs of a run, and the console progress bar.

Files under a run's workdir:

  metrics.jsonl                 one JSON object per logged step:
                                {"step": 12, "time": 1718000000.0, "loss": 0.31, ...};
                                non-finite values are written as null
  tensorboard/                  the same scalars as TensorBoard events (tensorboardX)
  trajectories/step_000012.jsonl  one JSON object per trajectory of step 12, each with "step"

Only process 0 writes. On other hosts the trajectory writer accepts calls and does nothing;
the metrics writer fetches each row at once into `latest` (so that every process can act on
the same values, e.g. stop on the same step) and writes no file.

Device values stay on the device until one `jax.device_get` per logged row fetches them all,
when the row is written: the loops act on them at once (health checks, the progress line).

Resuming. A run killed after step 40 but restored from the step-30 checkpoint would log steps
31..40 twice. Open the writers with `resume_step=30`: metrics.jsonl keeps only rows with
step <= 30, TensorBoard hides events after step 30 (tensorboardX's purge_step), and trajectory
files of later steps are deleted. A line cut short by a crash is dropped when metrics.jsonl is
reopened, so appends stay valid JSONL; `read_metrics` skips such a line too.

  with MetricsWriter(workdir, resume_step=start - 1) as writer, \\
       ProgressBar(num_steps, initial=start, keys=("reward", "loss")) as bar:
    for step in range(start, num_steps):
      ...
      writer.write(step, metrics)        # dict of scalars; jax.Array values are fine
      bar.update(step + 1, writer.latest)
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np
import tqdm
from absl import logging

from agentgym_jax import paths
from environments import jsonl

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
TRAJECTORY_DIR = "trajectories"
_RESERVED_KEYS = ("step", "time")
_TRAJECTORY_FILE = re.compile(r"step_(\d+)\.jsonl")


def _is_writer_process() -> bool:
  return jax.process_index() == 0


def _summary_writer_class() -> type:
  """tensorboardX's SummaryWriter, imported without torch.

  tensorboardX imports torch whenever it is installed (it is, for the parity tests), which
  costs seconds and hundreds of MB at start-up and is never used for scalars. A None entry in
  sys.modules makes that optional import fail fast, as on a machine without torch.
  """
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # type: ignore[assignment]
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


def _check_step(step: Any) -> int:
  if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
    raise ValueError(f"Logged step must be a non-negative integer, got {step!r}.")
  return int(step)


def _replace_file(path: str, lines: Sequence[str]) -> None:
  """Writes `lines` to `path` whole (paths.replace_file: atomic, local or in a bucket)."""
  paths.replace_file(path, "".join(lines))


def _parse_jsonl(path: str) -> list[dict[str, Any]]:
  """The JSON objects of a JSONL file ([] if there is none yet). A process killed mid-append
  can leave the last line cut short, which is skipped; any other bad line raises."""
  if not paths.is_remote(path):
    return jsonl.read(path, allow_truncated_tail=True) if os.path.exists(path) else []
  remote = paths.path(path)
  if not remote.exists():
    return []
  with tempfile.NamedTemporaryFile("w", suffix=".jsonl", encoding="utf-8") as local:
    local.write(remote.read_text(encoding="utf-8"))
    local.flush()
    return jsonl.read(local.name, allow_truncated_tail=True)


class _ObjectAppender:
  """A text file in a bucket opened for appending: objects cannot be appended to, so each flush
  writes the whole object again (a run's metrics.jsonl is small)."""

  def __init__(self, path: str):
    self._path = path
    self._text = paths.path(path).read_text(encoding="utf-8") if paths.path(path).exists() else ""

  def write(self, text: str) -> None:
    self._text += text

  def flush(self) -> None:
    paths.replace_file(self._path, self._text)

  def close(self) -> None:
    self.flush()


def _open_append(path: str) -> TextIO | _ObjectAppender:
  """`path` opened for appending text, local or in a bucket."""
  return _ObjectAppender(path) if paths.is_remote(path) else open(path, "a", encoding="utf-8")


def read_metrics(workdir: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """All rows of workdir/metrics.jsonl in file order ([] if there is none)."""
  return _parse_jsonl(os.path.join(os.fspath(workdir), METRICS_FILE))


def _to_host_scalar(value: Any) -> int | float | bool | None:
  """A fetched metric as a JSON scalar; NaN and infinities become None."""
  if isinstance(value, np.ndarray | np.generic):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _host_row(step: int, metrics: Mapping[str, Any]) -> dict[str, int | float | bool | None]:
  """A row's values fetched in one transfer, as JSON scalars (non-finite ones as None)."""
  values = {key: _to_host_scalar(value) for key, value in jax.device_get(dict(metrics)).items()}
  non_finite = sorted(key for key, value in values.items() if value is None)
  if non_finite:
    logging.warning("Non-finite metrics at step %d (logged as null): %s", step,
                    ", ".join(non_finite))
  return values


class MetricsWriter:
  """Appends scalar metrics per step to metrics.jsonl and TensorBoard.

  Args:
    workdir: the run directory, local or in a bucket (gs://).
    tensorboard: also write TensorBoard events to workdir/tensorboard.
    resume_step: the restored checkpoint step of a resumed run; logged rows after it are
      dropped (see module docstring).
    wandb: also log to Weights & Biases: `wandb.init`'s project, name and config. Each row
      is logged at its step; closing attaches `wandb_pages` and finishes the wandb run.
    wandb_pages: HTML pages attached to the wandb run when it closes, by name: each a function
      of the workdir returning the page (the run's viewer page, from the loop).
  """

  def __init__(self, workdir: str | os.PathLike[str], tensorboard: bool = True,
               resume_step: int | None = None, wandb: Mapping[str, Any] | None = None,
               wandb_pages: Mapping[str, Callable[[str], str]] | None = None):
    self.workdir = os.fspath(workdir)
    self.path = os.path.join(self.workdir, METRICS_FILE)
    # The last row written, as host values, for health checks and displays.
    self.latest: dict[str, Any] = {}
    self._file: TextIO | _ObjectAppender | None = None
    self._tensorboard = None
    self._wandb = None
    self._wandb_pages = dict(wandb_pages or {})
    self._writes = _is_writer_process()
    if not self._writes:
      return
    paths.path(self.workdir).mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
      last_kept = _check_step(resume_step)
      self._rewrite(lambda row: row["step"] <= last_kept)
    else:
      self._repair_last_line()
    self._file = _open_append(self.path)
    if wandb is not None:
      import wandb as wandb_lib
      self._wandb = wandb_lib.init(**wandb)
    if tensorboard:
      self._tensorboard = _summary_writer_class()(
          os.path.join(self.workdir, TENSORBOARD_DIR),
          purge_step=None if resume_step is None else resume_step + 1)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Logs scalar `metrics` (Python, NumPy or 0-d jax.Array values) for `step`."""
    step = _check_step(step)
    for key, value in metrics.items():
      if not isinstance(key, str) or key in _RESERVED_KEYS:
        raise ValueError(f"Metric names must be strings other than {_RESERVED_KEYS}, got "
                         f"{key!r}.")
      is_number = isinstance(value, numbers.Number | np.generic | np.ndarray | jax.Array)
      if not is_number or np.ndim(value) != 0:
        raise ValueError(f"Metric {key!r} at step {step} must be a scalar, got "
                         f"{type(value).__name__} of shape {np.shape(value)}.")
    if not self._writes:
      self.latest = {"step": step, "time": time.time(), **_host_row(step, metrics)}
      return
    if self._file is None:
      return
    self._emit(step, time.time(), dict(metrics))

  def flush(self) -> None:
    """Flushes both outputs."""
    if self._file is None:
      return
    self._file.flush()
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def truncate_after(self, step: int) -> None:
    """Drops rows with a step after `step` from metrics.jsonl."""
    step = _check_step(step)
    if self._file is None:
      return
    self.flush()
    self._file.close()
    self._rewrite(lambda row: row["step"] <= step)
    self._file = _open_append(self.path)

  def close(self) -> None:
    if self._file is None:
      return
    self.flush()
    self._file.close()
    self._file = None
    if self._tensorboard is not None:
      self._tensorboard.close()
      self._tensorboard = None
    if self._wandb is not None:
      self._finish_wandb()

  def _finish_wandb(self) -> None:
    """Attaches the pages and ends the wandb run."""
    import wandb as wandb_lib
    if self._wandb_pages:
      self._wandb.log(
          {name: wandb_lib.Html(page(self.workdir)) for name, page in self._wandb_pages.items()})
    self._wandb.finish()
    self._wandb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def _emit(self, step: int, wall_time: float, metrics: dict[str, Any]) -> None:
    values = _host_row(step, metrics)
    row = {"step": step, "time": wall_time, **values}
    self._file.write(json.dumps(row, allow_nan=False) + "\n")
    # One line per step is cheap to push to the OS, and a crash then loses no logged step.
    self._file.flush()
    if self._tensorboard is not None:
      for key, value in values.items():
        if value is not None:
          self._tensorboard.add_scalar(key, float(value), global_step=step, walltime=wall_time)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in values.items() if v is not None}, step=step)
    self.latest = row

  def _rewrite(self, keep: Callable[[dict[str, Any]], bool]) -> None:
    rows = [row for row in _parse_jsonl(self.path) if keep(row)]
    _replace_file(self.path, [json.dumps(row, allow_nan=False) + "\n" for row in rows])

  def _repair_last_line(self) -> None:
    """Ends the file at its last newline so appends after a crash start on a fresh line."""
    if paths.is_remote(self.path):  # An object is written whole; reading drops a cut line.
      if paths.path(self.path).exists():
        self._rewrite(lambda row: True)
      return
    if not os.path.exists(self.path):
      return
    with open(self.path, "rb+") as f:
      data = f.read()
      if not data or data.endswith(b"\n"):
        return
      cut = data.rfind(b"\n") + 1
      try:
        json.loads(data[cut:])
        f.write(b"\n")  # The row is whole; only its newline was lost.
      except json.JSONDecodeError:
        logging.warning("Dropping the truncated last line of %s.", self.path)
        f.truncate(cut)


def _trajectory_line(record: dict[str, Any]) -> str:
  try:
    return json.dumps(record, default=jsonl.json_safe, allow_nan=False) + "\n"
  except ValueError:  # A NaN somewhere: take the slower path that nulls it.
    return json.dumps(jsonl.json_safe(record), allow_nan=False) + "\n"


def _trajectory_path(directory: str, step: int) -> str:
  return os.path.join(directory, f"step_{step:06d}.jsonl")


def trajectory_steps(workdir: str | os.PathLike[str]) -> list[int]:
  """The steps that have a trajectory file, ascending."""
  directory = paths.path(workdir) / TRAJECTORY_DIR
  if not directory.is_dir():
    return []
  return sorted(
      int(match.group(1)) for file in directory.iterdir()
      if (match := _TRAJECTORY_FILE.fullmatch(file.name)))


def read_trajectories(workdir: str | os.PathLike[str],
                      step: int | None = None) -> list[dict[str, Any]]:
  """The trajectories logged at `step`, or those of every step in step order if None.

  Each record carries its "step", so the records of all steps stay distinguishable.
  """
  directory = os.path.join(os.fspath(workdir), TRAJECTORY_DIR)
  steps = trajectory_steps(workdir)
  if step is not None:
    if step not in steps:
      raise FileNotFoundError(f"No trajectories for step {step} in {directory}; logged steps: "
                              f"{steps}.")
    steps = [step]
  return [record for s in steps for record in _parse_jsonl(_trajectory_path(directory, s))]


class TrajectoryWriter:
  """Writes each step's trajectories to workdir/trajectories/step_{step:06d}.jsonl.

  A step's file is written under a temporary name and renamed into place, so a reader (or a
  resumed run) sees either the whole file or none; writing a step again replaces its file.
  Values may be NumPy or JAX arrays (written as lists); NaN and infinities become null.

  Args:
    workdir: the run directory, local or in a bucket (gs://).
    resume_step: the restored checkpoint step of a resumed run; files of later steps are
      deleted.
  """

  def __init__(self, workdir: str | os.PathLike[str], resume_step: int | None = None):
    self.workdir = os.fspath(workdir)
    self.directory = os.path.join(self.workdir, TRAJECTORY_DIR)
    if not _is_writer_process():
      return
    directory = paths.path(self.directory)
    directory.mkdir(parents=True, exist_ok=True)
    for file in directory.iterdir():
      if file.name.endswith(".tmp"):  # Left by a crash mid-write; never a complete file.
        file.unlink()
    if resume_step is not None:
      self.truncate_after(resume_step)

  def write(self, step: int, trajectories: Sequence[Mapping[str, Any]]) -> None:
    step = _check_step(step)
    for index, trajectory in enumerate(trajectories):
      if "step" in trajectory:
        raise ValueError(f"Trajectory {index} of step {step} has its own 'step' field; the "
                         "writer adds it.")
    if not _is_writer_process():
      return
    _replace_file(_trajectory_path(self.directory, step),
                  [_trajectory_line({"step": step, **trajectory}) for trajectory in trajectories])

  def truncate_after(self, step: int) -> None:
    """Deletes the files of steps after `step`."""
    step = _check_step(step)
    if not _is_writer_process():
      return
    for logged in trajectory_steps(self.workdir):
      if logged > step:
        paths.path(_trajectory_path(self.directory, logged)).unlink()


def duration(seconds: float) -> str:
  """A wall time for the console: 4m05s, or 1h12m past an hour."""
  minutes, seconds = divmod(round(seconds), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


class ProgressBar:
  """Console progress: a tqdm bar on a terminal, one plain line a step otherwise.

  A plain line (for logs and files) reads
    step 3/20  reward=0.25 success=0.125 time/rollout=41.2  eta 12m05s
  with the chosen metrics and the time left at the mean pace of the steps so far.

  Args:
    total: the number of steps of the run.
    keys: metric names shown, in this order, when present.
    initial: where the bar starts (a resumed run's first step).
    enabled: None draws the bar when stdout is a terminal and prints plain lines when it is
      not; True forces the bar, False shows nothing.
    file: the stream to draw on (default: sys.stderr for the bar, sys.stdout for lines).
    unit: what is counted.
  """

  def __init__(self, total: int, keys: Sequence[str] = (), initial: int = 0,
               enabled: bool | None = None, file: TextIO | None = None, unit: str = "step"):
    self.keys, self._unit = tuple(keys), unit
    self._total, self._initial, self._start = total, initial, time.monotonic()
    self._lines = enabled is None and not sys.stdout.isatty()
    self._file = file
    self._bar = tqdm.tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True, file=file,
                          disable=self._lines or (None if enabled is None else not enabled))

  def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
    """Moves the bar to `step` (steps done) and shows the chosen host-side `metrics`."""
    shown = {
        key: "nan" if metrics[key] is None else f"{metrics[key]:.4g}" for key in self.keys
        if metrics and key in metrics
    }
    if self._lines:
      print(self._line(step, shown), file=self._file or sys.stdout, flush=True)
      return
    self._bar.n = step
    self._bar.set_postfix(shown, refresh=False)
    self._bar.refresh()

  def _line(self, step: int, shown: Mapping[str, str]) -> str:
    parts = [f"{self._unit} {step}/{self._total}", " ".join(f"{k}={v}" for k, v in shown.items())]
    if step > self._initial:
      pace = (time.monotonic() - self._start) / (step - self._initial)
      parts.append(f"eta {duration(pace * (self._total - step))}")
    return "  ".join(part for part in parts if part)

  def close(self) -> None:
    self._bar.close()

  def __enter__(self) -> ProgressBar:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
