"""TextCraft: Minecraft crafting from text commands, native Python (AgentGym's TextCraft)."""

from environments.textcraft.env import TextCraftEnv, parse_action
from environments.textcraft.oracle import solve
from environments.textcraft.recipes import RecipeBook

__all__ = ["RecipeBook", "TextCraftEnv", "parse_action", "solve"]
