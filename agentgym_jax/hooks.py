"""The end of a training step and of a run, the same for the RL loop (trainer.py) and the
SFT/DPO loop (offline.py).

After each step, in this order: its metrics row (metrics.jsonl, TensorBoard, W&B), the health
check on the fetched row (non-finite updates, a sampler that drifted off-policy), the step's
trajectory log (RL), the progress line, and the checkpoint (every checkpoint.every steps and
at the last). At the end of the run: the progress closed, the checkpoints written through, the
writers closed.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any, Callable, Sequence

from agentgym_jax import checkpoint, metrics
from agentgym_jax.settings import Settings
from agentgym_jax.state import RunState
from agentgym_jax.tools import viewer


class StepHooks:
  """The step-end duties of a run that starts (or resumes) at `start_step`.

  Args:
    settings: the run's settings.
    workdir: the run directory.
    checkpointer: the run's checkpointer (already used to resume).
    start_step: the first step this call of the loop runs.
    progress_keys: the metrics the progress line shows.
    trajectory_log: whether the loop logs trajectories (RL): the log's directory is kept in
      step with the checkpoint (files after start_step deleted), and written when log.trajectories
      is on.
    shown: whether this process shows the progress line.
  """

  def __init__(self, settings: Settings, workdir: pathlib.Path,
               checkpointer: checkpoint.Checkpointer, start_step: int, progress_keys: Sequence[str],
               *, trajectory_log: bool = False, shown: bool = True):
    self.settings, self.checkpointer = settings, checkpointer
    log = settings.log
    wandb = (dict(project=log.wandb_project, name=log.wandb_run_name or workdir.name,
                  config=copy.deepcopy(settings.record)) if log.wandb else None)
    self.metrics = metrics.MetricsWriter(workdir, tensorboard=log.tensorboard,
                                         resume_step=start_step, wandb=wandb,
                                         wandb_pages={"viewer": viewer.page})
    self.trajectories = (metrics.TrajectoryWriter(workdir, resume_step=start_step)
                         if trajectory_log else None)
    self.progress = metrics.ProgressBar(settings.steps, keys=tuple(progress_keys),
                                        initial=start_step,
                                        enabled=None if log.progress_bar and shown else False)
    self.history: list[dict[str, Any]] = []

  def step_end(self, step: int, step_metrics: dict[str, Any], state: RunState, meta: dict[str, Any],
               trajectories: Callable[[], list[dict[str, Any]]] | None = None) -> None:
    """After step `step` (steps done): writes its metrics, checks its health, logs its
    trajectories (`trajectories()`, called only when logged), shows progress and checkpoints
    `state` with `meta` (when `saves(step)`)."""
    self.metrics.write(step, step_metrics)
    latest = self.metrics.latest
    self.history.append(latest)
    self.settings.health.check(latest)
    if self.trajectories is not None and self.settings.log.trajectories:
      self.trajectories.write(step, trajectories())
    self.progress.update(step, latest)
    if self.saves(step):
      self.checkpointer.save(step, state.tree(), self.settings.meta(step, **meta), force=True)

  def saves(self, step: int) -> bool:
    """Whether `step_end` checkpoints after step `step`: every checkpoint.every steps and at
    the run's last (none with checkpoint.every = 0)."""
    return bool(self.settings.checkpoint.every) and (self.checkpointer.should_save(step)
                                                     or step == self.settings.steps)

  def close(self) -> list[dict[str, Any]]:
    """Ends the run's logging and checkpointing; returns the metrics rows of this call."""
    self.progress.close()
    self.checkpointer.wait()
    self.checkpointer.close()
    self.metrics.close()
    return self.history
