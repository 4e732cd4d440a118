"""log.wandb: the config and every metrics row go to Weights & Biases, and the run's viewer page
is attached when the writer closes; in wandb's offline mode, which writes the run to a local
directory and needs no network or account."""

import time

import wandb

from agentgym_jax import metrics
from agentgym_jax.tools import viewer


def test_offline_run_holds_config_metrics_and_viewer(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path))
  monkeypatch.setenv("WANDB_SILENT", "true")
  logged = []
  real_init = wandb.init

  def recording_init(**kwargs):  # The real offline run, its log calls recorded on the way.
    run = real_init(**kwargs)
    real_log = run.log
    monkeypatch.setattr(run, "log", lambda data, **kw: (logged.append(
        (data, kw)), real_log(data, **kw))[1])
    return run

  monkeypatch.setattr(wandb, "init", recording_init)
  config = {"algorithm": {"advantage": "grpo"}, "seed": 7}
  with metrics.MetricsWriter(tmp_path / "run", tensorboard=False,
                             wandb=dict(project="tests", name="run", config=config),
                             wandb_pages={"viewer": viewer.page}) as writer:
    for step in range(3):
      writer.write(step, {"reward": step / 4, "loss": float("nan") if step == 1 else 1.0})
  # Rows at their steps (the NaN left out, as in TensorBoard), then the viewer page.
  assert [(data, kw) for data, kw in logged[:3]] == [({"reward": 0.0, "loss": 1.0}, {"step": 0}),
                                                     ({"reward": 0.25}, {"step": 1}),
                                                     ({"reward": 0.5, "loss": 1.0}, {"step": 2})]
  assert isinstance(logged[3][0]["viewer"], wandb.Html) and len(logged) == 4
  [run] = (tmp_path / "wandb").glob("offline-run-*")
  [page] = (run / "files" / "media" / "html").glob("viewer_*.html")
  assert "<html" in page.read_text().lower()
  # The record log, synced later by `wandb sync`, is written by wandb's service process, which
  # may still be flushing it when finish() returns on a loaded machine: read it until it holds
  # the config and the rows, for at most a minute.
  deadline = time.monotonic() + 60
  record_log = b""
  while not (b"grpo" in record_log and b"reward" in record_log) and time.monotonic() < deadline:
    time.sleep(0.2)
    record_log = next(run.glob("run-*.wandb")).read_bytes()
  assert b"grpo" in record_log and b"reward" in record_log
