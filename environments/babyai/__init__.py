"""BabyAI as text: minigrid's BabyAI levels with high-level actions expanded by path search.

The adapter needs minigrid (the `babyai` extra: pip install 'agentgym-jax[babyai]'), so
BabyAIEnv is imported on first use: the level list and the expert's module load without it.
"""

from environments.babyai.levels import LEVELS

__all__ = ["BabyAIEnv", "LEVELS"]


def __getattr__(name: str):
  if name == "BabyAIEnv":
    from environments.babyai.env import BabyAIEnv  # pylint: disable=import-outside-toplevel
    return BabyAIEnv
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
