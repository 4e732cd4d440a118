"""Draws a run's training curves as PNG images.

  python launch/plot.py --workdir=/tmp/run [--out_dir=/tmp/run/plots] [--smoothing=0.6]

Writes training_curves.png (every panel) and one <panel>.png per quantity the run logged:
reward, success (with per-category evaluation success), horizon cap, turns, KL, entropy,
tokens/s, phase times, loss, gradient norm, clipped fraction, log-prob gap, episode endings.
"""

from absl import app
from absl import flags
from absl import logging

from agentgym_jax.tools import plots

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (its metrics.jsonl).", required=True)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where the PNGs go (default workdir/plots).")
_SMOOTHING = flags.DEFINE_float(
    "smoothing", 0.6, "EMA weight in [0, 1) for noisy curves with >= 10 points (0: raw only).")


def main(argv: list[str]) -> None:
  del argv
  paths = plots.write_plots(_WORKDIR.value, _OUT_DIR.value, smoothing=_SMOOTHING.value)
  logging.info("Wrote %d images to %s", len(paths), paths[0].rsplit("/", 1)[0])
  print("\n".join(paths))


if __name__ == "__main__":
  app.run(main)
