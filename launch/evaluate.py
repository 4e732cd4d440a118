r"""Evaluates a policy on an environment split: the agentgym-eval command from a checkout.

  python launch/evaluate.py --config=configs/grpo_textcraft.py:local \
      --model=runs/local/export --config.eval.samples_per_task=4 --out=runs/local/eval.json

agentgym_jax/commands/evaluate.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.evaluate import main

if __name__ == "__main__":
  main()
