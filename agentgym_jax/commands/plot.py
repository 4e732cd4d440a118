"""agentgym-plot: draws a run's training curves as PNG images.

  agentgym-plot --workdir=/tmp/run [--out_dir=/tmp/run/plots] [--smoothing=0.6]

(From a checkout, `python launch/plot.py` with the same flags.) Writes training_curves.png
(every panel) and one <panel>.png per quantity the run logged: reward, success (with
per-category evaluation success), horizon cap, turns, KL, entropy, tokens/s, phase times, loss,
gradient norm, clipped fraction, log-prob gap, episode endings; and for a recipe's workdir
(the first command's) stages.png: RL training success as a moving average beside each stage's
held-out success, with the goals gained and lost between stages.
"""

import os

from absl import app, flags

from agentgym_jax import cli
from agentgym_jax.tools import plots

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (its metrics.jsonl).", required=True)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where the PNGs go (default workdir/plots).")
_SMOOTHING = flags.DEFINE_float(
    "smoothing", 0.6, "EMA weight in [0, 1) for noisy curves with >= 10 points (0: raw only).")


def _plot() -> None:
  if not 0 <= _SMOOTHING.value < 1:
    raise app.UsageError(f"--smoothing={_SMOOTHING.value} must be in [0, 1)")
  cli.check_run_directory(_WORKDIR.value, f"--workdir={_WORKDIR.value}")
  out_dir = _OUT_DIR.value or os.path.join(_WORKDIR.value, "plots")
  cli.directory_flag(out_dir, f"--out_dir={out_dir}")
  try:
    written = plots.write_plots(_WORKDIR.value, out_dir, smoothing=_SMOOTHING.value)
  except ValueError as error:  # A directory without metrics.
    raise app.UsageError(f"--workdir={_WORKDIR.value}: {error}") from None
  print("\n".join(written))


def main() -> None:
  """agentgym-plot."""
  cli.run(_plot)
