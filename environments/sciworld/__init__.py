"""SciWorld: ScienceWorld's elementary science tasks, through the `scienceworld` package's JVM.

The adapter needs scienceworld (the `sciworld` extra: pip install 'agentgym-jax[sciworld]'), so
its module (env.py: INVALID_ACTION, SciWorldEnv, parse_action) is imported on first use: the
task list and the expert's module load without it.
"""

from environments.sciworld.tasks import TASKS

__all__ = ["INVALID_ACTION", "SciWorldEnv", "TASKS", "parse_action"]
_FROM_ENV = ("INVALID_ACTION", "SciWorldEnv", "parse_action")


def __getattr__(name: str):
  if name in _FROM_ENV:
    from environments.sciworld import env  # pylint: disable=import-outside-toplevel
    return getattr(env, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
