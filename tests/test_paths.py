"""Runs in a bucket: gs:// workdirs, metrics, trajectories, demonstrations and model directories
go through agentgym_jax.paths (etils.epath) to an in-process fake of Cloud Storage (an fsspec
in-memory filesystem registered for the gs:// scheme), never to a local folder named "gs:"; a
bucket that cannot be reached stops the launch scripts at start-up with one line."""

import pathlib
import subprocess
import sys
import types

import fsspec
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

import tiny
from agentgym_jax import config as config_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import metrics, models, offline, paths, recipe
from agentgym_jax.models import weights
from environments import jsonl
from environments.textcraft import TextCraftEnv
from model_helpers import assert_loads_the_same

REPO = pathlib.Path(__file__).resolve().parents[1]


class FakeBucket(MemoryFileSystem):
  """Cloud Storage as the gcsfs backend presents it, held in this process's memory."""

  protocol = ("gs", "gcs")
  store: dict = {}
  pseudo_dirs = [""]


class ForbiddenBucket(MemoryFileSystem):
  """A bucket this machine may not use: every request is refused, as GCS answers 403."""

  protocol = ("gs", "gcs")

  def exists(self, path, **kwargs):
    raise PermissionError("403 caller does not have storage.objects.list access")


@pytest.fixture
def bucket(request, monkeypatch, tmp_path):
  """gs:// is FakeBucket, or the class a test passes as its parameter."""
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  registry = sys.modules["fsspec.registry"]  # Restored after the test: gs:// is ours only here.
  classes = dict(registry._registry)
  monkeypatch.setattr(registry, "_registry", classes)
  monkeypatch.setattr(registry, "registry", types.MappingProxyType(classes))
  for scheme in ("gs", "gcs"):
    fsspec.register_implementation(scheme, getattr(request, "param", FakeBucket), clobber=True)
  monkeypatch.setattr(FakeBucket, "store", {})
  monkeypatch.setattr(FakeBucket, "pseudo_dirs", [""])
  monkeypatch.chdir(tmp_path)  # Anything written as a local "gs:" folder would land here.
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  yield FakeBucket.store
  epath_backend.fsspec_backend._get_filesystem.cache_clear()
  assert not (tmp_path / "gs:").exists()


def test_workdir_in_the_bucket_is_checked_by_writing_there(bucket):
  directory = paths.check_directory("gs://runs/grpo", "--workdir=gs://runs/grpo")
  assert str(directory) == "gs://runs/grpo" and directory.is_dir()
  assert not any(key.endswith(".agentgym_write_probe") for key in bucket)  # Probe removed.


def test_metrics_and_trajectories_resume_in_the_bucket(bucket):
  workdir = "gs://runs/grpo"

  def logged():
    return [(row["step"], row["reward"]) for row in metrics.read_metrics(workdir)]

  with metrics.MetricsWriter(workdir, tensorboard=False) as writer:
    for step in range(3):
      writer.write(step, {"reward": step / 2})
  assert "gs://runs/grpo/metrics.jsonl" in bucket
  assert logged() == [(0, 0.0), (1, 0.5), (2, 1.0)]
  # Resumed from the step-1 checkpoint: step 2 is dropped, then logged again.
  with metrics.MetricsWriter(workdir, tensorboard=False, resume_step=1) as writer:
    writer.write(2, {"reward": 0.25})
  assert logged() == [(0, 0.0), (1, 0.5), (2, 0.25)]

  trajectories = metrics.TrajectoryWriter(workdir)
  for step in range(3):
    trajectories.write(step, [{"reward": step}, {"reward": -step}])
  assert metrics.trajectory_steps(workdir) == [0, 1, 2]
  metrics.TrajectoryWriter(workdir, resume_step=1)
  assert metrics.trajectory_steps(workdir) == [0, 1]
  assert [(r["step"], r["reward"]) for r in metrics.read_trajectories(workdir)] == [(0, 0), (0, 0),
                                                                                    (1, 1), (1, -1)]


def test_model_directory_in_the_bucket_loads_as_the_local_one(bucket, tmp_path):
  checkpoint = tiny.make_checkpoint(tmp_path / "tiny", seed=5)
  paths.copy_tree(checkpoint, "gs://models/tiny")
  assert "gs://models/tiny/model.safetensors" in bucket
  assert_loads_the_same("gs://models/tiny", str(checkpoint))
  with pytest.raises(weights.WeightsNotFoundError,
                     match="^model directory gs://models/absent cannot be read"):
    models.resolve("gs://models/absent")


def test_demonstrations_file_in_the_bucket_is_read_for_the_warm_start(bucket):
  demos = [
      dict(task_id=i, reward=1.0, messages=[dict(role="user", content=f"é {i}")]) for i in range(3)
  ]
  paths.replace_file("gs://data/demos.jsonl", "".join(map(jsonl.to_line, demos)))
  c = config_lib.base_config()
  c.warm_start.demonstrations = "gs://data/demos.jsonl"
  c.warm_start.steps = 2
  settings = settings_lib.Settings.from_config(c)
  source = recipe.demonstrations_file(settings, paths.path("gs://runs/grpo/warm_start"))
  assert str(source) == "gs://data/demos.jsonl"
  assert offline.load_records(source) == offline.load_records(str(source)) == demos
  # What the SFT run is given: the bucket path, not a local "gs:" folder.
  assert settings.warm_start_run(source).data.path == "gs://data/demos.jsonl"
  # Faults name the bucket path.
  paths.path("gs://data/bad.jsonl").write_text(jsonl.to_line(demos[0]) + "{not json\n")
  with pytest.raises(ValueError, match=r"gs://data/bad.jsonl:2 is not valid JSON"):
    offline.load_records("gs://data/bad.jsonl")
  with pytest.raises(ValueError, match=r"data.path='gs://data/absent.jsonl' does not exist"):
    offline.load_records("gs://data/absent.jsonl")


def test_demonstrations_made_by_the_expert_are_kept_in_the_bucket(bucket):
  c = config_lib.base_config()
  c.env.name = "textcraft"
  c.warm_start.max_tasks = 2
  made = recipe.demonstrations_file(settings_lib.Settings.from_config(c),
                                    paths.path("gs://runs/grpo/warm_start"))
  assert str(made) == "gs://runs/grpo/warm_start/demos.jsonl"
  records = offline.load_records(made)
  assert [r["task_id"] for r in records] == list(TextCraftEnv().task_ids("train")[:2])
  assert all(r["success"] for r in records)


@pytest.mark.parametrize("bucket", [ForbiddenBucket], indirect=True)
def test_forbidden_bucket_is_one_line(bucket):
  with pytest.raises(paths.UnreachablePathError) as error:
    paths.check_directory("gs://theirs/run", "--workdir=gs://theirs/run")
  message = str(error.value)
  assert message.startswith("--workdir=gs://theirs/run cannot be reached (PermissionError: 403")
  assert len(message.splitlines()) == 1


def test_train_with_an_unreachable_bucket_stops_at_start_up(tmp_path):
  """No fake here: this machine has no route to Cloud Storage (and no gcsfs, or no
  credentials), which is what an unreachable bucket looks like to the launch script."""
  done = subprocess.run(
      [
          sys.executable,
          str(REPO / "launch" / "train.py"), f"--config={REPO / 'configs' / 'ablation_echo.py'}",
          "--workdir=gs://no-such-bucket-agentgym/run"
      ], cwd=tmp_path, capture_output=True, text=True, timeout=120, env={
          "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO),
          "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:9",
          "GCE_METADATA_IP": "127.0.0.1:9"
      })
  assert done.returncode == 1, done.stderr[-2000:]
  assert done.stderr.startswith("error: --workdir=gs://no-such-bucket-agentgym/run cannot be "
                                "reached"), done.stderr[-2000:]
  assert len(done.stderr.strip().splitlines()) == 1
  assert not (tmp_path / "gs:").exists()
