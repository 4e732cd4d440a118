"""What the launch scripts share: absl's app.run with bad input reported in one line, quiet logs.

A user's mistake (an unknown config key, an invalid value, a config file or variant that does not
exist, a workdir that is a file or a bucket that cannot be reached, a model whose weights are not on disk) ends the script with
`error: ...` on stderr and exit status 1, never a traceback; a traceback means a defect. Library
INFO logs (Orbax's checkpoint manager, JAX's search for a TPU backend) are hidden unless
--verbosity=0 or higher asks for them.
"""

from __future__ import annotations

import sys
from typing import Callable

from absl import app, flags, logging

from agentgym_jax import config as config_lib
from agentgym_jax import paths
from agentgym_jax.models import weights


def _last_line(error: BaseException) -> str:
  """The message of a flag error, whose text may hold a whole traceback: its last line, with
  the exception class name dropped."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  last = lines[-1] if lines else type(error).__name__
  name, separator, message = last.partition(": ")
  return message if separator and name.replace(".", "").isidentifier() else last


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing; a config that cannot be loaded or overridden is reported in one line."""
  try:
    argv = flags.FLAGS(argv)
  except AttributeError as error:  # ml_collections: the key is not in the locked config.
    message = str(error.args[0] if error.args else error)
    message = message.replace("\\n", " ").replace("\\'", "").replace("'", "")
    sys.exit(f"error: invalid config: unknown key {' '.join(message.split())}")
  except flags.Error as error:
    sys.exit(f"error: {_last_line(error)}")
  for name in list(flags.FLAGS):
    flag = flags.FLAGS[name]
    if flag.flag_type() == "config object" and flag.value is not None:
      try:
        flag.value.keys()  # A config file that failed to load raises here, not while parsing.
      except OSError as error:
        sys.exit(f"error: --{name}={flag.serialize().partition('=')[2]}: {_last_line(error)}")
  return argv


def check_workdir(workdir: str) -> paths.Path:
  """The run's directory, local or gs://: it may exist (a resumed run) but must be a directory,
  and a bucket must be reachable and writable."""
  try:
    return paths.check_directory(workdir, f"--workdir={workdir}")
  except paths.UnreachablePathError as error:
    sys.exit(f"error: {error}")


def run(main: Callable[[list[str]], None]) -> None:
  """app.run(main) with one-line errors for bad input and library INFO logs hidden."""

  def guarded(argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    try:
      main(argv)
    except (config_lib.ConfigError, weights.WeightsNotFoundError, app.UsageError) as error:
      sys.exit(f"error: {error}")

  app.run(guarded, flags_parser=parse_flags)
