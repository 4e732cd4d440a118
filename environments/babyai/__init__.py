"""BabyAI as text: minigrid's BabyAI levels with high-level actions expanded by path search."""

from environments.babyai.env import BabyAIEnv
from environments.babyai.levels import LEVELS

__all__ = ["BabyAIEnv", "LEVELS"]
