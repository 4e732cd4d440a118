r"""Writes verified demonstrations for SFT and DPO: the agentgym-demos command from a checkout.

  python launch/make_demos.py --env=textcraft --split=train \
      --out=data/textcraft_train_demos.jsonl [--max_depth=2] [--limit=N] [--action_format=...]
  python launch/make_demos.py --env=textcraft --from_rollouts=/tmp/run --min_reward=1.0 \
      --out=data/textcraft_rollout_demos.jsonl

agentgym_jax/commands/make_demos.py has the flags and says what they do (--help lists them).
"""

from agentgym_jax.commands.make_demos import main

if __name__ == "__main__":
  main()
