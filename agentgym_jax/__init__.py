"""agentgym-jax: JAX/TPU-native multi-turn reinforcement learning for LLM agents."""

__version__ = "0.1.0"
