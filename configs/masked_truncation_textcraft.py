"""GRPO on TextCraft with ScalingInter-RL, episodes cut by a turn cap left out of the loss;
everything else as grpo_textcraft.py.

Under the staged horizon's short early caps (10 turns, 3 locally), a long craft that runs out of
turns is scored as a failure and teaches that long plans fail. With
algorithm.truncated_episodes=mask (rLLM's compact filtering) such an episode, and one cut by the
context limit or a step timeout, neither trains nor moves its group's baseline.
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {"algorithm.truncated_episodes": "mask"})
