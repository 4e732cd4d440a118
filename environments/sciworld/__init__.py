"""SciWorld: ScienceWorld's elementary science tasks, through the `scienceworld` package's JVM."""

from environments.sciworld.env import INVALID_ACTION, SciWorldEnv, parse_action
from environments.sciworld.tasks import TASKS

__all__ = ["INVALID_ACTION", "SciWorldEnv", "TASKS", "parse_action"]
