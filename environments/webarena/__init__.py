"""WebArena: web tasks in a real browser, judged by WebArena's evaluators (local or remote)."""

from environments.webarena.actions import Action, ActionParseError, parse_action, parse_reply
from environments.webarena.env import WebArenaEnv
from environments.webarena.evaluators import Evaluation, evaluate
from environments.webarena.remote import AgentGymWebArenaClient
from environments.webarena.tasks import Task, TaskConfigError, load_tasks

__all__ = [
    "Action", "ActionParseError", "AgentGymWebArenaClient", "Evaluation", "Task", "TaskConfigError",
    "WebArenaEnv", "evaluate", "load_tasks", "parse_action", "parse_reply"
]
