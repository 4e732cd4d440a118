r"""Trains an LLM agent with multi-turn RL: the agentgym-train command from a checkout.

  python launch/train.py --config=configs/grpo_textcraft.py:local --workdir=runs/local
  python launch/train.py --config=grpo_textcraft:local --config.optim.learning_rate=2e-5
  python launch/train.py --config=grpo_textcraft:local --print_config
  python launch/train.py --help

agentgym_jax/commands/train.py has the flags and says what they do.
"""

from agentgym_jax.commands.train import main

if __name__ == "__main__":
  main()
