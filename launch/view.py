"""Writes one self-contained HTML page for browsing a run's trajectories and curves.

  python launch/view.py --workdir=/tmp/run [--out=/tmp/run/viewer.html] [--max_steps=20]

The page (agentgym_jax/tools/viewer.py) has its data, styles and scripts inline: open it from disk in
any browser, offline, or copy it anywhere.
"""

import os

from absl import app
from absl import flags
from absl import logging

from agentgym_jax.tools import viewer

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics.jsonl, trajectories/).",
                               required=True)
_OUT = flags.DEFINE_string("out", None, "Where to write the page (default workdir/viewer.html).")
_MAX_STEPS = flags.DEFINE_integer(
    "max_steps", 0, "Embed the trajectories of only the last N logged steps (0: all); charts "
    "always cover every step.", lower_bound=0)


def main(argv: list[str]) -> None:
  del argv
  out = viewer.write_viewer(_WORKDIR.value, _OUT.value, max_steps=_MAX_STEPS.value)
  logging.info("Wrote %s (%.1f MB); open file://%s", out,
               os.path.getsize(out) / 2**20, os.path.abspath(out))
  print(os.path.abspath(out))


if __name__ == "__main__":
  app.run(main)
