"""agentgym-view: writes one self-contained HTML page for browsing a run's trajectories and
curves.

  agentgym-view --workdir=/tmp/run [--out=/tmp/run/viewer.html] [--max_steps=20]

(From a checkout, `python launch/view.py` with the same flags.) The page
(agentgym_jax/tools/viewer.py) has its data, styles and scripts inline: open it from disk in any
browser, offline, or copy it anywhere.
"""

import os

from absl import app, flags

from agentgym_jax import cli
from agentgym_jax.tools import viewer

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics.jsonl, trajectories/).",
                               required=True)
_OUT = flags.DEFINE_string("out", None, "Where to write the page (default workdir/viewer.html).")
_MAX_STEPS = flags.DEFINE_integer(
    "max_steps", 0, "Embed the trajectories of only the last N logged steps (0: all); charts "
    "always cover every step.", lower_bound=0)


def _view() -> None:
  cli.check_run_directory(_WORKDIR.value, f"--workdir={_WORKDIR.value}")
  out = _OUT.value or os.path.join(_WORKDIR.value, "viewer.html")
  cli.check_output_file(out, f"--out={out}")
  try:
    out = viewer.write_viewer(_WORKDIR.value, out, max_steps=_MAX_STEPS.value)
  except ValueError as error:  # load_run: a directory without metrics or trajectories.
    raise app.UsageError(f"--workdir={_WORKDIR.value}: {error}") from None
  print(f"Wrote {out} ({os.path.getsize(out) / 2**20:.1f} MB); open file://{os.path.abspath(out)}")


def main() -> None:
  """agentgym-view."""
  cli.run(_view)
