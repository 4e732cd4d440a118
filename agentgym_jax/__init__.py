"""agentgym-jax: JAX/TPU-native multi-turn reinforcement learning for LLM agents."""

__version__ = "0.1.0"


def load_model(*args, **kwargs):
  """`agentgym_jax.models.load_model`: (model, tokenizer) from a registry name or directory."""
  from agentgym_jax.models import load_model as load

  return load(*args, **kwargs)
