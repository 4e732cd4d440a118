"""Metrics JSONL/TensorBoard logging, trajectory files, resume truncation, the progress bar."""

import glob
import io
import json
import logging
import os
import re
import struct
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentgym_jax import metrics as metrics_lib
from agentgym_jax.metrics import (MetricsWriter, ProgressBar, TrajectoryWriter, read_metrics,
                                  read_trajectories, trajectory_steps)


def _strict_json_lines(path):
  """Parses every line, refusing the NaN / Infinity extensions that strict JSON lacks."""

  def refuse(constant):
    raise AssertionError(f"non-standard JSON constant {constant}")

  with open(path) as f:
    return [json.loads(line, parse_constant=refuse) for line in f]


def _tensorboard_scalars(logdir):
  """(tag, step, value) of every scalar event, read from the TFRecord-framed event files."""
  from tensorboardX.proto import event_pb2  # The writer has imported tensorboardX already.
  scalars = []
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      # Record: uint64 length, uint32 length CRC, payload, uint32 payload CRC.
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      scalars += [(value.tag, event.step, value.simple_value) for value in event.summary.value]
  return scalars


def test_rows_hold_step_time_and_host_values_of_device_arrays(tmp_path):
  before = time.time()
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(
        1, {
            "loss": jnp.float32(0.5), "turns": jnp.asarray(3), "count": 7, "kl": np.float64(0.25),
            "solved": True
        })
    writer.write(2, {"loss": jnp.float32(0.25)})
    assert writer.latest["step"] == 2 and writer.latest["loss"] == 0.25
  rows = _strict_json_lines(tmp_path / "metrics.jsonl")
  assert [row["step"] for row in rows] == [1, 2]
  assert before <= rows[0]["time"] <= rows[1]["time"] <= time.time()
  del rows[0]["time"]
  assert rows[0] == {"step": 1, "loss": 0.5, "turns": 3, "count": 7, "kl": 0.25, "solved": True}
  assert isinstance(rows[0]["turns"], int)
  assert read_metrics(tmp_path) == _strict_json_lines(tmp_path / "metrics.jsonl")


def test_each_row_is_fetched_in_one_device_get_when_written(tmp_path, monkeypatch):
  fetches = []
  real_device_get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda tree: fetches.append(tree) or real_device_get(tree))
  metrics = lambda step: {
      "loss": jnp.float32(step), "reward": jnp.float32(2 * step), "entropy": jnp.float32(0.5)
  }
  writer = MetricsWriter(tmp_path, tensorboard=False)
  writer.write(1, metrics(1))
  assert [row["step"] for row in read_metrics(tmp_path)] == [1] and len(fetches) == 1
  writer.write(2, metrics(2))
  writer.close()
  rows = read_metrics(tmp_path)
  assert [(row["step"], row["loss"], row["reward"]) for row in rows] == [(1, 1.0, 2.0),
                                                                         (2, 2.0, 4.0)]
  # One device_get per row of three metrics, not one per metric.
  assert len(fetches) == 2 and all(len(tree) == 3 for tree in fetches)


def test_non_finite_values_are_null_and_logged(tmp_path, caplog):
  with caplog.at_level(logging.WARNING), MetricsWriter(tmp_path) as writer:
    writer.write(5, {"loss": jnp.float32(jnp.nan), "ratio": float("inf"), "reward": 1.0})
  (row,) = _strict_json_lines(tmp_path / "metrics.jsonl")
  assert row["loss"] is None and row["ratio"] is None and row["reward"] == 1.0
  assert "Non-finite metrics at step 5" in caplog.text and "loss, ratio" in caplog.text
  # TensorBoard gets the finite scalar only.
  assert _tensorboard_scalars(tmp_path / "tensorboard") == [("reward", 5, 1.0)]


def test_tensorboard_events_hold_every_scalar_at_its_step(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    for step in range(3):
      writer.write(step, {"loss": jnp.float32(1.0 / (step + 1)), "reward/mean": 0.5 * step})
  scalars = sorted(_tensorboard_scalars(tmp_path / "tensorboard"))
  assert scalars == sorted([("loss", 0, 1.0), ("loss", 1, 0.5), ("loss", 2, np.float32(1 / 3)),
                            ("reward/mean", 0, 0.0), ("reward/mean", 1, 0.5),
                            ("reward/mean", 2, 1.0)])


def test_truncated_last_line_is_skipped_and_repaired_on_reopen(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(1, {"loss": 1.0})
    writer.write(2, {"loss": 0.5})
  path = tmp_path / "metrics.jsonl"
  with open(path, "a") as f:
    f.write('{"step": 3, "time": 17.0, "lo')  # Killed mid-append.
  assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(3, {"loss": 0.25})
  assert [(row["step"], row["loss"]) for row in _strict_json_lines(path)] == [(1, 1.0), (2, 0.5),
                                                                              (3, 0.25)]


def test_whole_row_missing_only_its_newline_is_kept_on_reopen(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "time": 1.0, "loss": 1.0}\n{"step": 2, "time": 2.0, "loss": 0.5}')
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(3, {"loss": 0.25})
  assert [row["step"] for row in _strict_json_lines(path)] == [1, 2, 3]


def test_corrupt_line_before_the_last_raises_with_its_line_number(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2,,}\n{"step": 3}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not valid JSON"):
    read_metrics(tmp_path)


def test_resume_drops_rows_after_the_restored_step(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in range(6):
      writer.write(step, {"loss": float(step)})
  with MetricsWriter(tmp_path, tensorboard=False, resume_step=2) as writer:
    assert [row["step"] for row in read_metrics(tmp_path)] == [0, 1, 2]
    writer.write(3, {"loss": 30.0})
  assert [(row["step"], row["loss"]) for row in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0),
                                                                            (2, 2.0), (3, 30.0)]


def test_other_processes_keep_the_latest_row_but_write_nothing(tmp_path, monkeypatch):
  monkeypatch.setattr(metrics_lib, "_is_writer_process", lambda: False)
  writer = MetricsWriter(tmp_path / "run")
  writer.write(3, {"loss": jnp.float32(0.5), "nonfinite_steps": jnp.int32(2)})
  # Fetched at once, so every process can stop on the same step.
  assert (writer.latest["step"], writer.latest["loss"],
          writer.latest["nonfinite_steps"]) == (3, 0.5, 2)
  writer.close()
  assert not (tmp_path / "run").exists()


def test_truncate_after_drops_later_rows(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in range(5):
      writer.write(step, {"loss": jnp.float32(step)})
    writer.truncate_after(2)
    writer.write(3, {"loss": jnp.float32(33.0)})
  assert [(row["step"], row["loss"]) for row in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0),
                                                                            (2, 2.0), (3, 33.0)]


@pytest.mark.parametrize("metrics, message", [
    ({"loss": jnp.zeros((2,))}, r"'loss' at step 0 must be a scalar, got .* shape \(2,\)"),
    ({"note": "fine"}, "'note' at step 0 must be a scalar"),
    ({"step": 1.0}, "Metric names must be strings other than"),
])
def test_non_scalar_and_reserved_metrics_are_rejected(tmp_path, metrics, message):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    with pytest.raises(ValueError, match=message):
      writer.write(0, metrics)


def test_trajectories_round_trip_per_step_with_arrays_as_lists_and_nan_as_null(tmp_path):
  writer = TrajectoryWriter(tmp_path)
  writer.write(3, [
      {
          "task": "textcraft/7", "tokens": np.arange(4, dtype=np.int32), "reward": 1.0,
          "turns": [{"action": "get 1 oak log", "observation": "Got 1 oak log"}]
      },
      {
          "task": "textcraft/8", "tokens": jnp.asarray([5, 6]), "reward": float("nan"),
          "logprobs": np.asarray([-0.5, np.nan], np.float32)
      },
  ])
  writer.write(12, [{"task": "babyai/1", "reward": np.float32(0.75)}])
  assert sorted(os.listdir(tmp_path / "trajectories")) == ["step_000003.jsonl", "step_000012.jsonl"]
  assert trajectory_steps(tmp_path) == [3, 12]
  step_3 = read_trajectories(tmp_path, 3)
  assert step_3 == [
      {
          "step": 3, "task": "textcraft/7", "tokens": [0, 1, 2, 3], "reward": 1.0,
          "turns": [{"action": "get 1 oak log", "observation": "Got 1 oak log"}]
      },
      {
          "step": 3, "task": "textcraft/8", "tokens": [5, 6], "reward": None,
          "logprobs": [-0.5, None]
      },
  ]
  assert _strict_json_lines(tmp_path / "trajectories" / "step_000003.jsonl") == step_3
  assert read_trajectories(tmp_path) == step_3 + [{"step": 12, "task": "babyai/1", "reward": 0.75}]
  with pytest.raises(FileNotFoundError, match=r"step 4 .*logged steps: \[3, 12\]"):
    read_trajectories(tmp_path, 4)


def test_trajectory_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
  writer = TrajectoryWriter(tmp_path)
  writer.write(1, [{"reward": 0.0}])

  def crash(*args):
    raise OSError("killed before the rename")

  monkeypatch.setattr(metrics_lib.os, "replace", crash)
  with pytest.raises(OSError):
    writer.write(1, [{"reward": 1.0}, {"reward": 1.0}])
  monkeypatch.undo()
  # The old file is intact; the half-finished temporary file is not a step of its own ...
  assert read_trajectories(tmp_path) == [{"step": 1, "reward": 0.0}]
  assert os.path.exists(tmp_path / "trajectories" / "step_000001.jsonl.tmp")
  # ... and is removed when a (resumed) run opens the directory again.
  TrajectoryWriter(tmp_path)
  assert os.listdir(tmp_path / "trajectories") == ["step_000001.jsonl"]


def test_trajectory_resume_deletes_later_steps(tmp_path):
  writer = TrajectoryWriter(tmp_path)
  for step in (2, 4, 6):
    writer.write(step, [{"reward": float(step)}])
  TrajectoryWriter(tmp_path, resume_step=4)
  assert trajectory_steps(tmp_path) == [2, 4]
  with pytest.raises(ValueError, match="has its own 'step' field"):
    writer.write(5, [{"step": 5}])


def test_progress_bar_shows_step_of_total_and_the_chosen_metrics(tmp_path):
  stream = io.StringIO()
  with ProgressBar(10, keys=("reward/mean", "loss", "absent"), enabled=True, file=stream) as bar:
    bar.update(3, {"reward/mean": 0.5, "loss": 0.1234567, "kl": 9.0, "step": 2})
  shown = stream.getvalue()
  assert "3/10" in shown
  assert "reward/mean=0.5" in shown and "loss=0.1235" in shown
  assert "kl" not in shown and "absent" not in shown


def test_progress_is_a_plain_line_a_step_off_a_terminal_and_silent_when_disabled(monkeypatch):
  monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
  stream = io.StringIO()
  with ProgressBar(10, keys=("reward", "time/update"), initial=2, file=stream) as bar:
    bar.update(3, {"reward": 0.25, "time/update": 12.34, "loss": 1.0})
    bar.update(4, {"reward": None})
  first, second = stream.getvalue().splitlines()
  assert re.fullmatch(r"step 3/10  reward=0.25 time/update=12.34  eta \dm\d\ds", first), first
  assert re.fullmatch(r"step 4/10  reward=nan  eta \dm\d\ds", second), second
  stream = io.StringIO()
  with ProgressBar(10, keys=("loss",), enabled=False, file=stream) as bar:
    bar.update(3, {"loss": 1.0})
  assert stream.getvalue() == ""
